"""``TRITON_DISAGG_CPU=avx2``: a process on any x86-64 behaves as an AVX2-only CPU (a Zen 3): our
kernel choices see no flag above AVX2's level, and torch's, fbgemm's and oneDNN's dispatch are
capped through their own variables before torch's first op."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.engine import cpu_kernels
from backend.engine.config import choose_weights_format
from backend.engine.formats import kernel_path_line

# a Zen 4's flags (AMD EPYC family 25 model 17), those that choose a kernel
ZEN4 = "fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx_vnni"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def zen4(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_cpuinfo", lambda: {"flags": ZEN4, "model name": "AMD EPYC"})


def test_unmasked_a_zen4_takes_its_vnni_kernel_and_bf16_formats(zen4, monkeypatch):
    monkeypatch.delenv(cpu_kernels.CPU_MASK_ENV, raising=False)
    monkeypatch.delenv("TRITON_DISAGG_KERNELS", raising=False)
    assert cpu_kernels.cpu_flags() == frozenset(ZEN4.split())
    assert cpu_kernels.masked_flags() == ()
    assert cpu_kernels.group_kernel() == "avx512_vnni"
    assert choose_weights_format("float32", "cpu", 1)[0] == "fp16w-bf16"


def test_masked_a_zen4_behaves_as_a_zen3(zen4, monkeypatch):
    monkeypatch.setenv(cpu_kernels.CPU_MASK_ENV, "avx2")
    monkeypatch.delenv("TRITON_DISAGG_KERNELS", raising=False)
    flags = cpu_kernels.cpu_flags()
    assert {"avx2", "fma", "f16c"} <= flags
    assert not any(f.startswith(("avx512", "avx_vnni")) for f in flags)
    assert cpu_kernels.masked_flags() == ("avx512_bf16", "avx512_vnni", "avx512bw", "avx512f", "avx512vl", "avx_vnni")
    assert cpu_kernels.group_kernel() == "avx2"
    assert cpu_kernels.missing_flags(cpu_kernels.GROUP_VNNI_FLAGS)
    # auto's choice is a Zen 3's: no bfloat16 products
    assert choose_weights_format("float32", "cpu", 1)[0] == "fp16w"


def test_an_unknown_mask_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_kernels.CPU_MASK_ENV, "avx512")
    with pytest.raises(ValueError, match="expected one of native, avx2"):
        cpu_kernels.cpu_flags()


def test_importing_backend_caps_torch_fbgemm_and_onednn_before_torch_runs():
    """In a new process, ``import backend`` sets the libraries' caps (a cap the user set stays), and
    torch then dispatches no wider than AVX2 (on an AVX2-only CPU that holds unmasked too: the
    variables are what this checks there)."""
    code = (
        "import os, backend, torch; torch.ones(8).sum(); "
        "print(os.environ['ATEN_CPU_CAPABILITY'], os.environ['FBGEMM_ENABLE_INSTRUCTIONS'], "
        "os.environ['ONEDNN_MAX_CPU_ISA'], torch.backends.cpu.get_cpu_capability())"
    )
    env = {k: v for k, v in os.environ.items() if k not in cpu_kernels.LIBRARY_CAPS}
    env.update({cpu_kernels.CPU_MASK_ENV: "avx2", "PYTHONPATH": str(ROOT)})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["avx2", "AVX2", "AVX2", "AVX2"]
    env["ATEN_CPU_CAPABILITY"] = "default"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["default", "AVX2", "AVX2", "DEFAULT"]


def test_the_kernel_path_says_what_is_masked(zen4, monkeypatch):
    monkeypatch.setenv(cpu_kernels.CPU_MASK_ENV, "avx2")
    path = cpu_kernels.KernelPath(
        cpu="AMD EPYC",
        cpu_id="family 25, model 17",
        isa=("avx2",),
        torch_capability="AVX2",
        mask="avx2",
        masked=cpu_kernels.masked_flags(),
    )
    assert "hidden: avx512_bf16 avx512_vnni" in path.mask_line and "ATEN_CPU_CAPABILITY=avx2" in path.mask_line
    assert cpu_kernels.mask_mismatch(path) is None
    assert "masked as an AVX2-only CPU" in kernel_path_line(path=path)
    wide = cpu_kernels.KernelPath(**{**path.__dict__, "torch_capability": "AVX512"})
    assert "torch dispatches AVX512" in (cpu_kernels.mask_mismatch(wide) or "")
