"""Benchmark: the linear layers of one SmolLM2-135M step (30 layers' q/k/v/o/gate/up/down and
the LM head, random weights) in each candidate weight format, at batch 1 and 16 rows (a decode
step, a batch of decodes; ``--batches`` adds others, e.g. 256, a prefill chunk, which takes
minutes: ``_weight_int8pack_mm`` is ~40x slower than fbgemm there): float32, bfloat16, and int8 weights (per
output channel) with

- activations quantized per row (per token) over fbgemm: ``weights_dtype=int8``
  (``backend/engine/int8_linear.py``: each row divided by its max |x|, one fixed 8-bit range);
- activations quantized per tensor (one scale per step, 7-bit ``reduce_range``): torch.ao's
  ``quantize_dynamic``, the former ``weights_dtype=int8``, fast but 2-3x float32's perplexity;
- activations quantized per row, symmetric int8, through ``torch._int_mm`` (int8 x int8 ->
  int32, oneDNN) and rescaled;
- float activations: ``torch.ops.aten._weight_int8pack_mm`` (weight-only int8);
- torchao's int8 dynamic-activation and int8 weight-only configs when torchao imports
  (``--torchao-path``: a folder it was installed into, e.g. ``pip install --no-deps --target DIR
  torchao``).

Median of 10 runs each, the candidates alternated round by round; this is how the engine's
int8 kernel was chosen. Prints a table and writes ``int8_kernels_<stamp>.json`` (ms per step,
each candidate and batch) to the results folder.

    python -m perf.bench_int8_kernels [--threads 2] [--batches 1,16] [--torchao-path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

from backend.planner.stats import median
from perf.lib.machine import cpu_model
from perf.lib.progress import bar
from perf.lib.results import results_dir

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN), (HIDDEN, INTER), (HIDDEN, INTER)]
SHAPES = SHAPES + [(INTER, HIDDEN)]
SHAPES = SHAPES * LAYERS + [(HIDDEN, VOCAB)]


def _layers(dtype=torch.float32) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList([torch.nn.Linear(i, o, bias=False) for i, o in SHAPES]).to(dtype).eval()


def _per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weights per output channel (row): (the int8 weights, each row's scale)."""
    scale = w.abs().amax(1).clamp_min(1e-12) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


class _IntMM(torch.nn.Module):
    """Per-row symmetric int8 activations x per-channel int8 weights through ``torch._int_mm``."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        w, self.w_scale = _per_channel_int8(linear.weight.detach())
        self.w_t = w.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
        return torch._int_mm(torch.round(x / scale).to(torch.int8), self.w_t) * (scale * self.w_scale)


class _WeightInt8Pack(torch.nn.Module):
    """Float activations x per-channel int8 weights through ``aten._weight_int8pack_mm``."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.w, self.scale = _per_channel_int8(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.w, self.scale)


def _per_tensor_int8(layers: torch.nn.ModuleList) -> torch.nn.Module:
    """The former ``weights_dtype=int8``: torch.ao dynamic quantization (per-tensor activations)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(layers, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


def _wrapped(layers: torch.nn.ModuleList, make) -> torch.nn.ModuleList:
    return torch.nn.ModuleList([make(lin) for lin in layers])


def _run_once(layers, xs) -> float:
    with torch.inference_mode():
        t0 = time.perf_counter()
        for lin in layers:
            lin(xs[lin.in_features])
        return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--batches", default="1,16")
    p.add_argument("--torchao-path", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from backend.engine.int8_linear import quantize_linear_int8

    candidates = {
        "float32": (_layers(), torch.float32),
        "bfloat16": (_layers(torch.bfloat16), torch.bfloat16),
        "int8, per-row activations, fbgemm (weights_dtype=int8)": (quantize_linear_int8(_layers()), torch.float32),
        "int8, per-tensor 7-bit activations, torch.ao fbgemm (former)": (_per_tensor_int8(_layers()), torch.float32),
        "int8, per-row activations, torch._int_mm": (_wrapped(_layers(), _IntMM), torch.float32),
        "int8 weight-only, aten._weight_int8pack_mm": (_wrapped(_layers(), _WeightInt8Pack), torch.float32),
    }
    if args.torchao_path:
        sys.path.insert(0, args.torchao_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

        def ao(config):
            layers = _layers()
            quantize_(layers, config)
            return layers

        candidates["torchao int8 dynamic activation"] = (ao(Int8DynamicActivationInt8WeightConfig()), torch.float32)
        candidates["torchao int8 weight-only"] = (ao(Int8WeightOnlyConfig()), torch.float32)
    except ImportError as e:
        print(f"torchao not measured: {e}")
    batches = [int(b) for b in args.batches.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    for batch in batches:
        inputs = {
            dtype: {n: torch.randn(batch, n, dtype=dtype) for n in (HIDDEN, INTER)}
            for dtype in {d for _, d in candidates.values()}
        }
        # the candidates alternated, so that load on the machine hits all alike
        for round_ in bar(range(13), f"batch {batch}"):
            for name, (layers, dtype) in candidates.items():
                elapsed = _run_once(layers, inputs[dtype])
                if round_ >= 3:
                    times.setdefault((name, batch), []).append(elapsed)
    header = " | ".join(f"ms, batch {b}" for b in batches)
    print(f"threads {args.threads}\n\n| format | {header} |\n|---|{'---|' * len(batches)}")
    for name in candidates:
        cells = " | ".join(f"{1e3 * median(times[(name, b)]):.1f}" for b in batches)
        print(f"| {name} | {cells} |", flush=True)
    ms = {name: {str(b): 1e3 * median(times[(name, b)]) for b in batches} for name in candidates}
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    result = {"cpu": cpu_model(), "threads": args.threads, "runs_per_median": 10, "ms_per_step": ms}
    (out / f"int8_kernels_{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
