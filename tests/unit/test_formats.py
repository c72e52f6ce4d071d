"""The format registry (``backend/engine/formats.py``): its entries are consistent with the kernels
they name, and the kernel-path line names each format's kernels, on this process's path or a
recorded one."""

from __future__ import annotations

import pytest

from backend.engine import cpu_kernels
from backend.engine.cpu_kernels import KernelPath, kernel_path
from backend.engine.formats import FASTEST_FIRST, FORMATS, WEIGHT_FORMATS, kernel_path_line, weight_format


def test_every_entry_names_kernels_that_exist_and_agrees_with_itself():
    for name, fmt in FORMATS.items():
        assert fmt.name == name
        assert fmt.few_rows in {"f32", "f16", "group", "torch"} and fmt.many_rows in {"mkl", "fp16w", "bf16", "torch"}
        # an Fp16Linear format (many_dtype) multiplies few rows by float16 weights or groups
        assert (fmt.many_dtype is not None) == (fmt.few_rows in {"f16", "group"}), name
        assert fmt.groups == (fmt.few_rows == "group") and (fmt.fused == 4) == fmt.groups, name
        assert fmt.kv16 == (fmt.cpu_only is not None), name  # float16 KV under the CPU formats
        assert (fmt.many_rows == "bf16") == (cpu_kernels.BF16_PRODUCTS in fmt.needs), name
    assert set(FASTEST_FIRST) == {n for n, f in FORMATS.items() if f.quality is not None}
    assert WEIGHT_FORMATS == ("auto", *FORMATS)
    for removed in ("int8", "int4w-a8", "int4w-a8-bf16"):
        with pytest.raises(ValueError, match=r"must be one of \['auto', 'float32'"):
            weight_format(removed)


def test_the_kernel_path_line_names_each_formats_kernels():
    path = kernel_path()
    assert kernel_path_line().startswith(f"kernel path: {path.cpu} ({path.cpu_id}); torch {path.torch_capability}")
    assert kernel_path_line("int4w").startswith(kernel_path_line() + "; int4w: ")
    assert path.int4w_path in kernel_path_line("int4w") and "for up to 16 rows" in kernel_path_line("fp16w")
    assert kernel_path_line("bfloat16").endswith(f"bfloat16: torch's kernels ({path.torch_capability})")
    vnni = KernelPath("CPU", "family 25, model 17", ("avx2",), "AVX512", group_kernel="avx512_vnni")
    assert "our kernels AVX-512 VNNI; int4w: " in kernel_path_line("int4w", vnni) and "AVX-512 VNNI kernel" in (
        kernel_path_line("int4w", vnni)
    )
