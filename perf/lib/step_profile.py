"""Where an engine step's time goes: steps run once unprofiled (their wall time) and once under
torch's profiler (CPU), each op's own time (``self_cpu_time_total``: its children's excluded, so
nothing counts twice) summed by op class, the op calls per step, and the rest of the step, the
wall time minus the ops' own time: Python, dispatch and the scheduler between the ops.

The classes go by op name (first match): our group kernel (int4w's products and its fused decode
steps, named by ``group_matmul.profiled``), linear products (MKL's, fbgemm's fp16-weight),
attention (scaled dot product), KV pages (gathering and storing), sampling, norms / rotary /
activations (the elementwise ops), views and other ops."""

from __future__ import annotations

import time
from collections.abc import Callable

from backend.planner.stats import median

CLASSES: list[tuple[str, Callable[[str], bool]]] = [
    # our kernel library's calls (int4w's group products, the float32 and float16 products of few
    # rows, the fused decode steps), which it names for the profiler (``group_matmul.profiled``)
    ("our kernel library", lambda n: n.startswith("group_kernel::")),
    (
        "linear products",
        lambda n: (
            n.startswith("aten::fbgemm")
            or n in {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}
        ),
    ),
    ("attention", lambda n: "scaled_dot_product" in n or "flash_attention" in n),
    (
        "KV pages",
        lambda n: (
            n
            in {"aten::index_select", "aten::index_put_", "aten::_index_put_impl_", "aten::index_copy_", "aten::index"}
        ),
    ),
    (
        "sampling",
        lambda n: (
            n in {"aten::argmax", "aten::topk", "aten::sort", "aten::softmax", "aten::log_softmax", "aten::multinomial"}
        ),
    ),
    (
        "norms, rotary, activations",
        lambda n: (
            n
            in {
                "aten::rms_norm",
                "aten::_fused_rms_norm",
                "aten::silu",
                "aten::silu_",
                "aten::mul",
                "aten::mul_",
                "aten::add",
                "aten::add_",
                "aten::sub",
                "aten::rsqrt",
                "aten::pow",
                "aten::mean",
                "aten::neg",
                "aten::cat",
                "aten::embedding",
                "aten::cos",
                "aten::sin",
            }
        ),
    ),
    (
        "views",
        lambda n: (
            n
            in {
                "aten::view",
                "aten::reshape",
                "aten::_reshape_alias",
                "aten::slice",
                "aten::select",
                "aten::narrow",
                "aten::permute",
                "aten::transpose",
                "aten::t",
                "aten::unsqueeze",
                "aten::squeeze",
                "aten::expand",
                "aten::as_strided",
                "aten::split",
                "aten::split_with_sizes",
                "aten::unflatten",
                "aten::flatten",
                "aten::contiguous",
                "aten::empty",
                "aten::empty_like",
                "aten::empty_strided",
                "aten::resize_",
                "aten::detach",
                "aten::alias",
            }
        ),
    ),
]
OTHER = "other ops"
OUTSIDE = "outside ops (Python, dispatch)"


def op_class(name: str) -> str:
    return next((cls for cls, match in CLASSES if match(name)), OTHER)


def profile_steps(step: Callable[[], object], steps: int) -> dict:
    """``step`` run ``steps`` times unprofiled, then ``steps`` times profiled: the median wall
    time per step (ms), the op calls per step, and ms per step by class, ``OUTSIDE`` included."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    by_class = {cls: 0.0 for cls, _ in CLASSES} | {OTHER: 0.0}
    calls, top = 0, {}
    for event in prof.key_averages():
        by_class[op_class(event.key)] += event.self_cpu_time_total / 1000 / steps
        calls += event.count
        top[event.key] = event.self_cpu_time_total / 1000 / steps
    wall_ms = median(walls) * 1000
    by_class[OUTSIDE] = max(wall_ms - sum(by_class.values()), 0.0)
    heaviest = sorted(top.items(), key=lambda kv: -kv[1])[:8]
    return {"wall_ms": wall_ms, "op_calls": calls / steps, "ms": by_class, "heaviest_ops_ms": dict(heaviest)}


def markdown(rows: dict[str, dict]) -> str:
    """One column per profiled case (``rows``: label -> :func:`profile_steps`' result), one row
    per class, ms per step and its share of the wall time."""
    labels = list(rows)
    classes = [cls for cls, _ in CLASSES] + [OTHER, OUTSIDE]
    lines = ["| ms per step (share) | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for cls in classes:
        cells = [f"{r['ms'][cls]:.2f} ({100 * r['ms'][cls] / r['wall_ms']:.0f}%)" for r in rows.values()]
        lines.append(f"| {cls} | " + " | ".join(cells) + " |")
    lines.append("| **wall time** | " + " | ".join(f"**{r['wall_ms']:.2f}**" for r in rows.values()) + " |")
    lines.append("| op calls per step | " + " | ".join(f"{r['op_calls']:.0f}" for r in rows.values()) + " |")
    return "\n".join(lines)
