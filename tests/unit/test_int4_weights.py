"""``weights_dtype=int4w``: the 4-bit groups (GGUF Q4_1's layout) and the LM head's 8-bit groups
(GGUF Q8_0's), our kernel's products against float64's within the bound of its int16 activations,
the row limit, rows that do not depend on each other, a refused shape, a compiler that fails, the
refusal on a CPU without the kernel's features, and the engine's greedy tokens against
transformers' on the same (grouped) weights. Each on both versions of the kernel, which read the
same tiles of 16 rows, where the CPU has them (the ``kernels`` fixture): AVX2 (any CPU,
``TRITON_DISAGG_KERNELS=avx2``) and AVX-512 VNNI (skipped, with the reason, on a CPU without it).
The real checkpoint's quality: ``tests/integration/test_int4w_quality.py``."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import time
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from backend.engine import cpu_kernels, fp16_linear, group_linear, group_matmul, model_runner
from backend.engine.config import EngineConfig
from backend.engine.formats import kernel_path_line
from backend.engine.group_matmul import dequantize, product, quantize_int4, quantize_int8
from backend.engine.int4_linear import Int4Linear
from backend.engine.int8_group_linear import Int8GroupLinear
from backend.engine.sampling_params import SamplingParams
from tests.engine_helpers import assert_pool_idle, build_tiny_llama, make_engine, run_to_completion, tokens_of
from tests.unit.test_weight_formats import PROMPT, _hf_greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-int4w"))


def grouped(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` rounded to its 4-bit groups (what int4w multiplies by), computed here from Q4_1's
    definition (minimum and range over 15, both in float16), apart from the kernel's layout."""
    n, k = weight.shape
    g = weight.detach().float().view(n, k // 32, 32)
    low = g.amin(-1, keepdim=True).half().float()
    d = ((g.amax(-1, keepdim=True) - low) / 15).half().float()
    q = torch.round((g - low) / torch.where(d == 0, 1.0, d)).clamp(0, 15)
    return (q * d + low).view(n, k)


def layer(n: int = 96, k: int = 192, exact: bool = True, max_rows: int = 8) -> tuple[Int4Linear, torch.Tensor]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        if exact:
            linear.weight.copy_(grouped(linear.weight))
    return Int4Linear(linear, max_rows), linear.weight.detach().clone()


def int16_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far the kernel's products may be from the exact ones: each activation is rounded to
    its group's int16 grid (at most half a step, 1/65534 of the group's largest magnitude), and
    the sums are float32's (a few ulps of the largest term)."""
    groups = x.shape[-1] // 32
    step = x.abs().view(-1, groups, 32).amax(-1) / 65534  # [M, G]
    per_group = weight.abs().view(weight.shape[0], groups, 32).sum(-1)  # [N, G]
    return 1.01 * step.double() @ per_group.double().t() + 1e-6 * (x.abs().double() @ weight.abs().double().t())


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
def test_exact_groups_multiply_within_the_int16_activations_bound(rows, kernels):
    print(kernel_path_line("int4w"))
    int4, weight = layer()
    assert int4.group_error == 0.0  # every group exact: a Q4_1 checkpoint's weights
    assert torch.equal(dequantize(int4.groups), weight)
    torch.manual_seed(rows)
    x = torch.randn(rows, 192) * torch.where(torch.rand(192) < 0.05, 20.0, 1.0)  # a few outlier channels
    want = x.double() @ weight.double().t()
    got = int4(x)
    assert got.shape == (rows, 96)
    assert ((got.double() - want).abs() <= int16_bound(x, weight)).all()
    assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-3


def test_the_lm_heads_8_bit_groups_hold_q8_0_exactly_and_multiply_within_the_bound(kernels):
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (64, 96)).float()
    q[:, ::32] = 127  # every group holds its largest magnitude, as Q8_0's do
    d = (torch.rand(64, 3) * 0.01).half().float()  # Q8_0's scales are float16
    weight = (q.view(64, 3, 32) * d[..., None]).view(64, 96)
    groups = quantize_int8(weight)
    assert groups.error == 0.0 and torch.equal(dequantize(groups), weight)
    linear = torch.nn.Linear(96, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    head = Int8GroupLinear(linear, max_rows=8)
    x = torch.randn(11, 96)
    got = head(x)
    assert ((got.double() - x.double() @ weight.double().t()).abs() <= int16_bound(x, weight)).all()
    assert torch.equal(head(x[:1]), got[:1])  # a row's result does not depend on the other rows
    many = torch.randn(17, 96)  # beyond 16 rows: float32's products (fp16w's limit, 8, is below the kernel's)
    assert head.wider._packed_weight is None and torch.equal(head(many), F.linear(many, weight))
    linear.weight.data.add_(1e-3)  # no longer Q8_0's values: rounded, and the error reported
    assert 0 < Int8GroupLinear(linear, max_rows=8).group_error <= 0.5 / 127 + 1e-6


def test_a_rows_result_does_not_depend_on_the_other_rows(kernels):
    """Nor on how many rows share the product, up to the kernel's 16 (fp16w's beyond)."""
    int4, _ = layer()
    x = torch.randn(16, 192)
    alone = int4(x[:1])[0]
    for count in (1, 3, 8, 9, 16):
        other = x[:count].clone()
        other[1:] = torch.randn(count - 1, 192)
        assert torch.equal(int4(x[:count])[0], int4(other)[0])
        assert torch.equal(int4(other)[0], alone)
        assert torch.equal(int4(x[:count])[-1], int4(x[count - 1 : count])[0])  # the last row too
    assert torch.equal(int4(x.view(4, 4, 192)).view(16, 96), int4(x))  # any leading shape


def test_more_rows_take_fp16ws_products(kernels):
    """With fp16w's limit above the kernel's 16 rows (32 here, as on one thread's 64): 17-32 rows
    take fp16w's float16 products, 33 its float32 ones; with it at or below 16 (2 threads) no
    float16 copy is made and 17 rows take float32's."""
    int4, weight = layer(exact=False, max_rows=32)
    x = torch.randn(33, 192)
    packed = int4.wider._packed_weight
    assert torch.equal(int4(x[:17]), torch.fbgemm_linear_fp16_weight_fp32_activation(x[:17], packed, None))
    assert torch.equal(int4(x), F.linear(x, weight))
    narrow, _ = layer(exact=False, max_rows=16)
    assert narrow.wider._packed_weight is None and torch.equal(narrow(x[:17]), F.linear(x[:17], weight))


def test_both_kernels_compute_the_same_products():
    """The AVX-512 VNNI kernel and the AVX2 one read the same tiles: their products differ only in
    the order of the float32 sums (here at most 2e-6 of the largest output)."""
    from backend.engine import cpu_kernels

    missing = cpu_kernels.missing_flags(cpu_kernels.GROUP_VNNI_FLAGS)
    if missing:
        pytest.skip(reason=f"the AVX-512 VNNI kernel needs {', '.join(missing)}, which this CPU lacks")
    torch.manual_seed(3)
    w = torch.randn(160, 320) * 0.05
    x = torch.randn(12, 320)
    four, eight = quantize_int4(w), quantize_int8(w)
    lib = group_matmul.library()
    for rows in (1, 5, 12):
        for groups in (four, eight):
            outs = []
            for code in (1, 2):
                out = torch.empty(rows, 160)
                args = (groups.q.data_ptr(), groups.d.data_ptr(), x[:rows].data_ptr(), out.data_ptr())
                if groups.m is not None:
                    call = lib.int4_matmul(*args[:2], groups.m.data_ptr(), *args[2:], rows, 160, 320, 1, code)
                else:
                    call = lib.int8_matmul(*args, rows, 160, 320, 1, code)
                assert call == 0
                outs.append(out)
            assert (outs[0] - outs[1]).abs().max() <= 2e-6 * outs[0].abs().max()


def test_outputs_not_in_whole_tiles_are_padded():
    """A weight of 40 rows is held as 48 (three tiles, the last 8 rows zeros); products and the
    dequantized weight have its 40."""
    torch.manual_seed(4)
    w = grouped(torch.randn(40, 64) * 0.05)
    groups = quantize_int4(w)
    assert groups.padded == 48 and groups.n == 40 and torch.equal(dequantize(groups), w)
    x = torch.randn(3, 64)
    got = product(groups, x)
    assert got.shape == (3, 40)
    assert ((got.double() - x.double() @ w.double().t()).abs() <= int16_bound(x, w)).all()


def test_weights_that_are_not_groups_report_their_error_and_multiply_their_groups():
    int4, weight = layer(exact=False)
    assert 0 < int4.group_error < 0.034  # half a step of a group's range (1/30), d rounded to float16
    assert torch.equal(dequantize(int4.groups), grouped(weight))
    x = torch.randn(2, 192)
    want = x.double() @ grouped(weight).double().t()
    assert ((int4(x).double() - want).abs() <= int16_bound(x, grouped(weight))).all()


def test_inputs_not_in_groups_of_32_are_refused():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize_int4(torch.randn(8, 48))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize_int8(torch.randn(8, 48))


def test_a_compiler_that_fails_fails_the_load_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_DISAGG_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    group_matmul.library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"compiling \w+\.c failed"):
            group_matmul.library()
    finally:
        group_matmul.library.cache_clear()
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left to load


FAKE_CC = """#!{python}
import pathlib, shutil, sys
with open({log!r}, "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
out = sys.argv[sys.argv.index("-o") + 1]
if "-c" in sys.argv:
    pathlib.Path(out).write_bytes(b"")  # an object
else:
    shutil.copyfile({good!r}, out)  # the link: this run's good build
"""


def test_a_damaged_cached_build_is_built_again_never_loaded(tmp_path, monkeypatch, caplog):
    """A cached library whose bytes no longer hash to its name (truncated), or that names its own
    checksum but is no library, is removed and built again; the rebuilt one computes. The compiler
    here is a stand-in that records its command and writes this run's good build (the real
    compile is the one ``library()`` ran): the cache's checks, not cc, are under test."""
    import os
    import shutil
    import sys

    group_matmul.library.cache_clear()
    good = Path(group_matmul.library()._name)  # this run's build (from its cache, or built now)
    assert good.name.startswith(f"group_matmul-{group_matmul.build_key(os.environ.get('CC', 'cc'))}-")
    calls = tmp_path / "cc-calls"
    fake_cc = tmp_path / "fake-cc"
    fake_cc.write_text(FAKE_CC.format(python=sys.executable, log=str(calls), good=str(good)))
    fake_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(fake_cc))
    monkeypatch.setenv("TRITON_DISAGG_CACHE", str(tmp_path / "cache"))
    folder = group_matmul.cache_dir()
    folder.mkdir(parents=True)
    key = group_matmul.build_key(str(fake_cc))
    truncated = folder / f"group_matmul-{key}-{hashlib.sha256(good.read_bytes()).hexdigest()[:16]}.so"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # its name's checksum, half its bytes
    junk = folder / f"group_matmul-{key}-{hashlib.sha256(b'junk').hexdigest()[:16]}.so"
    junk.write_bytes(b"junk")  # bytes that hash to its name, but no library
    group_matmul.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="triton_disagg.engine"):
            lib = group_matmul.library()
        damaged = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
        assert len(damaged) == 2, damaged
        assert any(truncated.name in m and "do not match its name's checksum" in m for m in damaged), damaged
        assert any(junk.name in m and "does not load" in m for m in damaged), damaged
        commands = [c.split() for c in calls.read_text().splitlines()]  # built once: each source, one link
        assert sorted(c[-1] for c in commands if "-c" in c) == sorted(map(str, group_matmul.sources())), commands
        assert sum("-shared" in c for c in commands) == 1, commands
        assert lib.tiles_supported() in (0, 1)
        (rebuilt,) = folder.glob("group_matmul-*.so")
        assert rebuilt.name == truncated.name  # the good bytes, named by their checksum
        x, w = torch.randn(2, 64), torch.randn(16, 64)
        torch.testing.assert_close(group_matmul.f32_product(w, x), x @ w.t(), rtol=1e-5, atol=1e-5)
    finally:
        group_matmul.library.cache_clear()
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_int4w_is_refused_on_a_cpu_without_its_features(tiny, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "f16c"}))
    with pytest.raises(ValueError, match="needs the CPU features avx2 and f16c and fma.*lacks fma"):
        EngineConfig(model_path=str(tiny), weights_dtype="int4w")


@pytest.mark.parametrize("decoder", ["auto", "transformers"])
def test_int4w_tokens_equal_transformers_on_the_grouped_weights(tiny, decoder, kernels, monkeypatch):
    """The prompt prefilled in chunks, then 12 greedy tokens, every product through the 4-bit
    groups (the row limits lifted): transformers' own on the float32 model whose decoder-layer
    weights were rounded to those groups and whose LM head was rounded to 8-bit groups."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(model_runner, "fp16_max_rows", lambda threads: 10**9)
    monkeypatch.setattr(fp16_linear, "fp16_max_rows", lambda threads: 10**9)
    monkeypatch.setattr(group_linear, "MAX_ROWS", 10**9)
    engine = make_engine(tiny, weights_dtype="int4w", decoder=decoder)
    model = engine.runner.model
    assert isinstance(model.lm_head, Int8GroupLinear)
    int4 = [m for m in model.model.layers.modules() if isinstance(m, Int4Linear)]
    assert int4 and not [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    reference = AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    with torch.no_grad():
        for m in reference.model.layers.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(grouped(m.weight))
        q8 = reference.lm_head.weight.view(-1, 32)
        d8 = (q8.abs().amax(-1, keepdim=True) / 127).half().float()  # Q8_0's rounding, from its definition
        head = (torch.round(q8 / torch.where(d8 == 0, 1.0, d8)).clamp(-127, 127) * d8).view_as(reference.lm_head.weight)
        reference.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    want = _hf_greedy(reference, PROMPT, 12)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    assert tokens_of(run_to_completion(engine)["r"]) == want
    assert_pool_idle(engine)


def test_auto_takes_int4w_only_for_a_checkpoint_of_q4_1_layers(tiny, tmp_path, monkeypatch):
    """``weights_dtype=auto``: int4w (int4w-bf16 with AMX-BF16) where ``prepare`` recorded that the
    decoder layers came from Q4_1 blocks (int4w's groups hold them exactly); fp16w's family for a
    checkpoint without that record or with other layer types (int4w would round its weights)."""
    import shutil

    from backend.engine.checkpoint_source import layers_in_int4w_groups, write_source

    q4 = tmp_path / "q4"
    shutil.copytree(tiny, q4)
    types = {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q4_1", "blk.0.attn_norm.weight": "F32"}
    write_source(q4, "tiny.Q4_1.gguf", types)
    assert layers_in_int4w_groups(q4) == "tiny.Q4_1.gguf" and layers_in_int4w_groups(tiny) is None
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "f16c", "fma"}))
    config = EngineConfig(model_path=str(q4))
    assert config.weights_format == "int4w", config.weights_choice
    assert "the layers are tiny.Q4_1.gguf's Q4_1 blocks" in config.weights_choice
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "f16c", "fma", "amx_bf16"}))
    chosen = EngineConfig(model_path=str(q4))
    assert chosen.weights_format == "int4w-bf16"
    assert "(int4w-bf16 1.001x, " in chosen.weights_choice, chosen.weights_choice
    assert EngineConfig(model_path=str(tiny)).weights_format == "fp16w-bf16"
    write_source(q4, "tiny.Q4_0.gguf", {**types, "blk.0.attn_k.weight": "Q4_0"})
    assert layers_in_int4w_groups(q4) is None
    assert EngineConfig(model_path=str(q4)).weights_format == "fp16w-bf16"
    (q4 / "gguf_source.json").write_text("{not json")
    assert layers_in_int4w_groups(q4) is None


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_products_split_between_threads_equal_one_threads(rows, kernels):
    """The kernel splits a product's output rows between the caller and helper threads: every
    output is computed as on one thread, bit for bit."""
    four, eight = quantize_int4(torch.randn(256, 192) * 0.05), quantize_int8(torch.randn(256, 192) * 0.05)
    x = torch.randn(rows, 192)
    for threads in (2, 3):
        assert torch.equal(product(four, x, threads), product(four, x, 1))
        assert torch.equal(product(eight, x, threads), product(eight, x, 1))


@pytest.fixture(scope="module")
def hooked_library():
    """The library built with its test hooks (``kernels/test_hooks.h``: one build for every hook,
    set at run time; from the build cache after the first run)."""
    return hooked(group_matmul.build(HOOKS))


HOOKS = ("-DTEST_HOOKS",)


def hooked(lib):
    """``lib`` (a build with ``HOOKS``) with ``test_hooks_set(first_job, helper_delay_ns)`` typed."""
    lib.test_hooks_set.argtypes = [ctypes.c_long, ctypes.c_long]
    lib.test_hooks_set.restype = ctypes.c_int
    return lib


def test_helpers_late_to_a_job_they_are_not_needed_for_never_take_the_next_one(monkeypatch, kernels, hooked_library):
    """A helper that sees a job it is not needed for (a product on fewer threads) and is then
    preempted must not read the job that follows as that one: it ran the next job's part twice,
    counted it twice, and the next job returned before its last part was written (-inf columns in
    CI) or ran a part against a finished product (a crash). The hooked library pauses in that
    window (``helper_delay_ns``), so the interleaving happens on every try; products on 1, 2 and 3
    threads, taking turns, are each equal to one thread's, bit for bit."""
    assert hooked_library.test_hooks_set(0, 20000) == 0
    monkeypatch.setattr(group_matmul, "library", lambda: hooked_library)
    four, eight = quantize_int4(torch.randn(256, 2048) * 0.05), quantize_int8(torch.randn(256, 2048) * 0.05)
    wrong = []
    for attempt in range(40):
        x = torch.randn(9, 2048)
        for groups in (four, eight):
            want = product(groups, x, 1)
            for threads in (2, 3):
                if not torch.equal(product(groups, x, threads), want):
                    wrong.append((attempt, groups.bits, threads))
    assert not wrong, f"products that differ from one thread's (attempt, bits, threads): {wrong}"


ROOT = Path(__file__).resolve().parents[2]
WRAP_CHECK = """
import ctypes, sys, torch
from backend.engine import group_matmul
from backend.engine.group_matmul import product, quantize_int4
lib = group_matmul._typed(ctypes.CDLL(sys.argv[1]))
lib.test_hooks_set.argtypes = [ctypes.c_long, ctypes.c_long]
if lib.test_hooks_set(int(sys.argv[2]), 0) != 0:
    sys.exit("test_hooks_set refused the first job number")
group_matmul.library = lambda: lib
four = quantize_int4(torch.randn(256, 192) * 0.05)
for i in range(120):
    x = torch.randn(1 + i % 9, 192)
    for threads in (2, 3):
        if not torch.equal(product(four, x, threads), product(four, x, 1)):
            sys.exit(f"job {i}: {threads} threads differ from one")
"""


WRAP_FIRST_JOBS = (2**19 - 40, 2**20 - 40)


@pytest.mark.parametrize("first_job", WRAP_FIRST_JOBS)
def test_jobs_go_on_across_the_job_tags_wrap(hooked_library, first_job):
    """The pool's cursors carry the job number's low 19 bits as a tag: across its wrap (and where a
    20-bit tag once made the cursor negative, which no thread could take from: a hang) products
    go on, equal to one thread's. The hooked library's job numbers start there (``first_job``); run
    in a child so that a hang fails this test, not the suite."""
    import subprocess
    import sys

    try:
        done = subprocess.run(
            [sys.executable, "-c", WRAP_CHECK, hooked_library._name, str(first_job)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"products hung around job {first_job + 120}")
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_forked_child_gets_its_own_helper_threads():
    """Helpers started in the parent do not exist in a forked child: the child's products start
    their own (with the parent's count it would wait for them forever)."""
    import os

    four = quantize_int4(torch.randn(256, 192) * 0.05)
    x = torch.randn(1, 192)
    want = product(four, x, 2)  # the parent's helper exists now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when the product is right, 1 otherwise; a hang fails the wait below
        ok = torch.equal(product(four, x, 2), want)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child's product did not finish in 30 s (it waited for its parent's helpers)")
