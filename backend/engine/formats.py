"""The weight formats (``EngineConfig.weights_dtype``), one entry each: what it needs from the CPU,
which kernels take its products of few rows (decode steps) and of many (prefill chunks), its
activations, its KV default, whether the fused decode step takes it and its held-out quality;
``auto``'s choice among them (:func:`choose_weights_format`), ``kv_dtype=auto``'s
(:func:`choose_kv_format`), and :func:`kernel_path_line`, the one line that says which kernel path
runs (the server's log at load, the test run's header and every ``perf/REPORT.md`` section print
it). The configuration, the model runner, the linear layers and the fused decode step read these
entries; no other table is keyed by a format's name.

The kernels (their row limits are measured where they are built): ``f32`` our float32 product
and ``f16`` our float16-weight one (``group_matmul.f32_product``, up to ``FLOAT_ROWS`` rows),
``group`` our group kernel (``group_matmul.product``, up to ``group_linear.MAX_ROWS`` rows), ``mkl``
torch's float32 products, ``fp16w`` fbgemm's float16-weight GEMM up to ``fp16_max_rows`` rows
then float32 weights (``fp16_linear.py``), ``bf16`` oneDNN's bfloat16 products
(``bf16_linear.py``), ``torch`` torch's own kernels in the format's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from backend.engine.checkpoint_source import layers_in_int4w_groups
from backend.engine.cpu_kernels import BF16_PRODUCTS, KernelPath, kernel_path, missing_flags, requirement

# torch's float dtypes by name (torch is imported where a dtype is needed: a front or router that
# only parses settings never loads it)
DTYPES = ("float32", "float16", "bfloat16")
# the most rows our few-row kernels take (group_linear.MAX_ROWS, group_matmul.FLOAT_ROWS: measured
# there); a decode step of up to this many sequences runs as one fused call
FEW_ROWS = 16


@dataclass(frozen=True)
class Quality:
    """Held-out quality against float32, teacher forced through the engine
    (``tests/integration/test_fp16w_quality.py``, ``test_int4w_quality.py``, ``perf/REPORT.md``):
    the worst perplexity ratio measured on any kernel path (the worse of the prompt positions and
    the decode steps) and the lowest next-token argmax agreement on the decode steps (the tokens a
    request returns)."""

    perplexity: float
    agreement: float


@dataclass(frozen=True)
class WeightFormat:
    """One weights format. ``needs``: the CPU features it needs (/proc/cpuinfo's spelling; "a|b":
    either; :func:`missing_flags` reads them, so a feature mask applies); ``few_rows`` and
    ``many_rows``: the kernels of its products of up to :data:`FEW_ROWS` rows and of more (module
    docstring); ``groups``: the decoder layers in 4-bit groups and the LM head in 8-bit ones;
    ``activations``: the activations' dtype; ``many_dtype``: the dtype of an ``Fp16Linear``'s
    many-row products (None: the format keeps no ``Fp16Linear``); ``kv16``: ``kv_dtype=auto``
    keeps float16 KV under it on the CPU; ``fused``: the weights the fused decode step reads under
    it (4: 4-bit groups, 16: float16, 32: float32; None: the step does not take it); ``cpu_only``:
    its kernels, named in a refusal (None: it runs anywhere torch does); ``quality``: its held-out
    quality against float32 (None: float32 itself, or not faster on the CPU); ``exact_source``:
    ``auto`` takes it only where the checkpoint's layers came from Q4_1 blocks, which its groups
    hold exactly."""

    name: str
    few_rows: str
    many_rows: str
    needs: tuple[str, ...] = ()
    groups: bool = False
    activations: str = "float32"
    many_dtype: str | None = None
    kv16: bool = False
    fused: int | None = None
    cpu_only: str | None = None
    quality: Quality | None = None
    exact_source: bool = False

    def kernels(self, path: KernelPath) -> str:
        """Which kernels take its products on ``path``: "<few> for up to 16 rows; <many> for more"."""
        few, many = _kernel(self.few_rows, path), _kernel(self.many_rows, path)
        return few if few == many else f"{few} for up to {FEW_ROWS} rows; {many} for more"


_GROUP_KERNEL = "our group kernel (AVX2 and FMA; AVX-512 VNNI where the CPU has it)"
_FP16W_GEMM = "fbgemm's fp16-weight GEMM"
_FP16W_FLAGS = ("avx2", "f16c")

# fp16w: float16 weights, float32 activations and sums; prefill chunks exactly float32's
_FP16W = WeightFormat(
    "fp16w",
    "f16",
    "fp16w",
    _FP16W_FLAGS,
    many_dtype="float32",
    kv16=True,
    fused=16,
    cpu_only=_FP16W_GEMM,
    quality=Quality(1.001, 1.0),  # 1.0003x, 100%
)
# int4w: the decoder layers' weights in 4-bit groups of 32 (GGUF Q4_1's layout, exact for a
# checkpoint converted from one), the LM head in 8-bit groups (Q8_0's), through our group kernel
# for few rows (int16 activations per group, exact integer sums per group); fp16w's products for
# many. On the project's SmolLM2 (Q4_1 layers; as served, seven windows, 2 threads) 1.0000x /
# 0.9998x, 100%; on other checkpoints it rounds the weights to 4 bits: not measured, and auto
# never takes it there.
_INT4W = replace(
    _FP16W,
    name="int4w",
    few_rows="group",
    needs=(*_FP16W_FLAGS, "fma"),
    groups=True,
    fused=4,
    cpu_only=f"{_GROUP_KERNEL}, {_FP16W_GEMM}",
    quality=Quality(1.0, 1.0),
    exact_source=True,
)


def _bf16(base: WeightFormat, quality: Quality) -> WeightFormat:
    """``base`` with oneDNN's bfloat16 products (AMX tiles or AVX512-BF16) for many rows."""
    return replace(
        base,
        name=f"{base.name}-bf16",
        many_rows="bf16",
        needs=(*base.needs, BF16_PRODUCTS),
        many_dtype="bfloat16",
        cpu_only=f"{base.cpu_only}, oneDNN's bfloat16 (AMX-BF16 or AVX512-BF16)",
        quality=quality,
    )


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        # float32 on the CPU: our float32 product for few rows where the kernel library builds
        # (small_batch_linear.py) and in the fused step; exact, the reference of every quality figure
        WeightFormat("float32", "f32", "mkl", fused=32),
        WeightFormat("float16", "torch", "torch", activations="float16"),
        WeightFormat("bfloat16", "torch", "torch", activations="bfloat16"),
        _FP16W,
        _bf16(_FP16W, Quality(1.001, 0.9955)),  # 1.0007x / 0.9995x, 99.55% (seven windows, 2 threads)
        _INT4W,
        _bf16(_INT4W, Quality(1.001, 0.9955)),  # 1.0007x / 0.9994x, 99.55%
    )
}
# what weights_dtype accepts ("auto": choose_weights_format)
WEIGHT_FORMATS = ("auto", *FORMATS)
# the formats faster than float32 on the CPU, fastest first: auto's candidates (measured on Zen 3,
# Zen 4 and an Intel Xeon with AMX, perf/REPORT.md)
FASTEST_FIRST = ("int4w-bf16", "int4w", "fp16w-bf16", "fp16w")


def weight_format(name: str) -> WeightFormat:
    """The entry of ``name`` (a format's name, not ``auto``); ValueError naming the formats there are."""
    if name not in FORMATS:
        raise ValueError(f"weights format must be one of {list(WEIGHT_FORMATS)}, got {name!r}")
    return FORMATS[name]


def _kernel(kind: str, path: KernelPath) -> str:
    """One kernel of the module docstring, as it runs on ``path``."""
    ours = "AVX-512" if path.group_kernel == "avx512_vnni" else "AVX2+FMA"
    if kind == "f32":
        return f"our float32 product ({ours} kernel)"
    if kind == "f16":
        return f"our float16-weight product, float32 sums ({ours} kernel, F16C)"
    if kind == "group":
        return path.int4w_path
    if kind == "mkl":
        return "torch's float32 products (MKL)"
    if kind == "fp16w":
        return "fbgemm's fp16-weight GEMM on one thread up to its row limit and float32 weights (MKL) past it"
    if kind == "bf16":
        return path.bf16_path
    return f"torch's kernels ({path.torch_capability})"


def kernel_path_line(fmt: str | None = None, path: KernelPath | None = None) -> str:
    """The kernel path as one line: the CPU, torch's capability, our kernels' version and, given a
    format, the kernels of its few-row and many-row products. ``path``: a recorded one (a result
    envelope's), default this process's."""
    path = path or kernel_path()
    ours = "AVX-512 VNNI" if path.group_kernel == "avx512_vnni" else "AVX2+FMA"
    line = f"kernel path: {path.cpu} ({path.cpu_id}); torch {path.torch_capability}"
    line += f"; our kernels {ours}" if path.group_kernel else ""
    line += f"; masked as an AVX2-only CPU ({path.mask})" if path.mask != "native" else ""
    return line + (f"; {fmt}: {weight_format(fmt).kernels(path)}" if fmt else "")


KV_AUTO_WHY = (
    "float16 KV: the fused decode step reads half the bytes (an 8-sequence step over 1,000-token contexts "
    "26.7 ms against 36.6 on a Zen 4), held-out quality as float32 KV's (float32 weights: perplexity 1.0000x, "
    "1,728 of 1,728 decode steps' tokens the same)"
)


def choose_kv_format(dtype: str, weights_format: str, device: str) -> tuple[str, str]:
    """``kv_dtype=auto``: (the KV pool's dtype, why)."""
    if device == "cpu" and dtype == "float32" and FORMATS[weights_format].kv16:
        return "float16", KV_AUTO_WHY
    if device != "cpu":
        return dtype, f"as dtype on {device}"
    return dtype, f"as dtype under {weights_format} weights" + (" (exact)" if weights_format == "float32" else "")


QUALITY_LIMIT = 1.01  # perplexity at most 1.01x float32's
AGREEMENT_LIMIT = 0.99  # and at most one decode-step next token in a hundred other than float32's


def choose_weights_format(
    dtype: str, device_type: str, tensor_parallel_size: int, model_path: str | None = None
) -> tuple[str, str]:
    """``weights_dtype=auto``: (format, why). The fastest format within float32's quality (held-out
    perplexity at most 1.01x float32's and decode-step argmax agreement at least 99% on every
    kernel path measured) whose kernels this CPU has: int4w-bf16 or int4w where the checkpoint at
    ``model_path`` was converted from a GGUF whose decoder layers were Q4_1 blocks (its
    ``gguf_source.json``: int4w's groups hold those weights exactly), on a CPU with AMX-BF16 or
    AVX512-BF16 (its prefill chunks in bfloat16) or with AVX2, FMA and F16C; otherwise fp16w-bf16
    (fp16w's decode products, prefill chunks in bfloat16) on a CPU with AMX-BF16 or AVX512-BF16,
    else fp16w (float16 weights, float32 sums) on one with AVX2 and F16C; one process, ``dtype``
    float32. Otherwise ``dtype`` itself."""
    if dtype != "float32":
        return dtype, f"dtype {dtype}"
    if device_type != "cpu":
        return dtype, f"on {device_type} the weights are dtype's ({dtype})"
    if tensor_parallel_size != 1:
        return dtype, "fp16w runs in one process and tensor_parallel_size > 1"
    source = layers_in_int4w_groups(model_path) if model_path else None
    fast = [FORMATS[name] for name in FASTEST_FIRST if source or not FORMATS[name].exact_source]
    within = [f for f in fast if _within(f)]
    runnable = [f for f in within if not missing_flags(f.needs)]
    if not runnable:
        needs = within[-1].needs
        return dtype, f"fp16w needs {requirement(needs)}; this CPU lacks {', '.join(missing_flags(needs))}"
    best = runnable[0]
    rest = ", ".join(_quality(f) for f in fast if f not in within)
    skipped = [f"{f.name} needs {', '.join(missing_flags(f.needs))}" for f in within[: within.index(best)]]
    where = f"; the layers are {source}'s Q4_1 blocks" if source else "; int4w: not a Q4_1 checkpoint"
    return best.name, (
        f"the fastest format within {QUALITY_LIMIT}x float32's held-out perplexity and "
        f"{100 * AGREEMENT_LIMIT:.0f}% next-token agreement that this CPU runs ({_quality(best)}"
        + (f"; not within: {rest}" if rest else "")
        + "".join(f"; {s}" for s in skipped)
        + where
        + ")"
    )


def _within(f: WeightFormat) -> bool:
    q = f.quality
    return q is not None and q.perplexity <= QUALITY_LIMIT and q.agreement >= AGREEMENT_LIMIT


def _quality(f: WeightFormat) -> str:
    assert f.quality is not None
    return f"{f.name} {f.quality.perplexity:.3f}x, {100 * f.quality.agreement:.1f}%"
