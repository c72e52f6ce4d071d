"""Benchmark: the linear layers of one SmolLM2-135M decode step (30 layers' q/k/v/o/gate/up/down
and the LM head, random weights) in each candidate weight format, at batch 1 and 16: float32,
bfloat16, torch's dynamic int8 over fbgemm (what ``weights_dtype=int8`` uses), and torchao's
int8 dynamic-activation and int8 weight-only configs when torchao imports (``--torchao-path``: a
folder it was installed into, e.g. ``pip install --no-deps --target DIR torchao``). Median of 10
runs each; this is how the engine's int8 kernel was chosen.

    python -m perf.bench_int8_kernels [--threads 2] [--torchao-path DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN), (HIDDEN, INTER), (HIDDEN, INTER)]
SHAPES = SHAPES + [(INTER, HIDDEN)]
SHAPES = SHAPES * LAYERS + [(HIDDEN, VOCAB)]


def _layers(dtype=torch.float32) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList([torch.nn.Linear(i, o, bias=False) for i, o in SHAPES]).to(dtype).eval()


def _ms(layers, batch: int, dtype=torch.float32) -> float:
    xs = {n: torch.randn(batch, n, dtype=dtype) for n in (HIDDEN, INTER)}
    times = []
    with torch.inference_mode():
        for i in range(13):
            t0 = time.perf_counter()
            for lin in layers:
                lin(xs[lin.in_features])
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--torchao-path", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from backend.engine.model_runner import quantize_linear_int8

    rows = {
        "float32": lambda b: _ms(_layers(), b),
        "bfloat16": lambda b: _ms(_layers(torch.bfloat16), b, torch.bfloat16),
        "int8 dynamic, fbgemm (weights_dtype=int8)": lambda b: _ms(quantize_linear_int8(_layers()), b),
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

        rows["torchao int8 dynamic activation"] = lambda b: _ms(ao(Int8DynamicActivationInt8WeightConfig()), b)
        rows["torchao int8 weight-only"] = lambda b: _ms(ao(Int8WeightOnlyConfig()), b)
    except ImportError as e:
        print(f"torchao not measured: {e}")
    print(f"threads {args.threads}\n\n| format | ms, batch 1 | ms, batch 16 |\n|---|---|---|")
    for name, measure in rows.items():
        print(f"| {name} | {measure(1):.1f} | {measure(16):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
