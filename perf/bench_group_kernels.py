"""Benchmark: int4w's group kernel (``backend/engine/kernels/``, one file per version), each version this
CPU runs (AVX2 always, AVX-512 VNNI where the CPU has it) side by side, on the products of one
SmolLM2-135M decode step (per layer q/k/v, o, gate/up and down as int4w fuses them, 30 layers,
and the LM head's 8-bit groups; random weights of those shapes, read from memory as in serving:
80 MB of 4-bit tiles and 32 MB of LM head), for a few rows (decode steps of that many sequences)
and thread counts. Best of ``--repeats`` per cell, the versions alternated. This is how
``group_linear.MAX_ROWS`` and the two versions were measured. Beside each cell, its roof
(``perf/lib/vector_peak.py``): the least time the step's products can take on that many cores,
the longer of their multiply-adds at the CPU's measured peak rate of the version's instruction
("a": arithmetic) and their weights' bytes read once at the measured rate those cores read memory
("m"); a cell near 100% of its roof is bound by that, and only fewer or cheaper products, or fewer
bytes, make it faster. Prints a table and writes ``group_kernels_<stamp>.json`` (ms per step by
version, threads and rows; the peaks, the read rates and the roofs) to the results folder.

    python -m perf.bench_group_kernels [--rows 1,2,4,8,16] [--threads 1,2] [--repeats 5] [--layers 30]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from backend.engine import cpu_kernels, group_matmul
from perf.lib import vector_peak
from perf.lib.machine import cpu_model
from perf.lib.results import results_dir

# SmolLM2-135M's products per layer (out, in): q/k/v fused, o, gate/up fused, down; its LM head
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD_SHAPE = (49152, 576)


def versions() -> list[str]:
    """The kernel versions this CPU runs (``group_matmul.KERNELS``' names)."""
    vnni = not cpu_kernels.missing_flags(cpu_kernels.GROUP_VNNI_FLAGS) and group_matmul.library().tiles_supported()
    return ["avx2", "avx512_vnni"] if vnni else ["avx2"]


def step_macs(layers: int) -> tuple[int, int]:
    """Multiply-adds of one row's products: the 4-bit groups', the LM head's 8-bit groups'."""
    return layers * sum(n * k for n, k in LAYER_SHAPES), HEAD_SHAPE[0] * HEAD_SHAPE[1]


def step_products(layers: int) -> list[group_matmul.Groups]:
    torch.manual_seed(0)
    weights = [group_matmul.quantize_int4(torch.randn(n, k) * 0.05) for _ in range(layers) for n, k in LAYER_SHAPES]
    return weights + [group_matmul.quantize_int8(torch.randn(*HEAD_SHAPE) * 0.05)]


def time_step(products: list[group_matmul.Groups], inputs: dict[int, torch.Tensor], rows: int, threads: int, code: int):
    lib = group_matmul.library()
    out = torch.empty(rows, HEAD_SHAPE[0])
    start = time.perf_counter()
    for g in products:
        x = inputs[g.k][:rows]
        ptrs = (g.q.data_ptr(), g.d.data_ptr())
        if g.m is not None:
            m = g.m.data_ptr()
            rc = lib.int4_matmul(*ptrs, m, x.data_ptr(), out.data_ptr(), rows, g.padded, g.k, threads, code)
        else:
            rc = lib.int8_matmul(*ptrs, x.data_ptr(), out.data_ptr(), rows, g.padded, g.k, threads, code)
        if rc != 0:
            raise RuntimeError(f"group kernel {code} refused a product ({rc})")
    return time.perf_counter() - start


def _part(roofs: dict, i: int) -> dict:
    """Part ``i`` of each (time, bound) roof cell (None where a version has no roof)."""
    return {
        n: {t: {r: None if v is None else v[i] for r, v in c.items()} for t, c in by.items()} for n, by in roofs.items()
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    if min(rows) < 1 or min(threads) < 1 or args.repeats < 1 or args.layers < 1:
        p.error("--rows, --threads, --repeats and --layers must be positive")
    names = versions()
    flags = cpu_kernels.cpu_flags()
    peaks_before = {str(t): vector_peak.peaks(flags, t) for t in threads}  # again after: the best of both
    read_before = {str(t): vector_peak.read_bandwidth(t) for t in threads}  # likewise
    products = step_products(args.layers)
    inputs = {k: torch.randn(max(rows), k).contiguous() for k in {g.k for g in products}}
    ms: dict[str, dict[str, dict[str, float]]] = {n: {str(t): {} for t in threads} for n in names}
    for t in threads:
        for r in rows:
            best = {n: float("inf") for n in names}
            for _ in range(args.repeats + 1):  # the first round warms up (page faults, helper threads)
                for n in names:
                    best[n] = min(best[n], time_step(products, inputs, r, t, group_matmul.KERNELS[n]))
            for n in names:
                ms[n][str(t)][str(r)] = 1e3 * best[n]
    path = cpu_kernels.kernel_path()
    peaks = {
        str(t): {k: max(v, peaks_before[str(t)][k]) for k, v in vector_peak.peaks(flags, t).items()} for t in threads
    }
    read = {str(t): max(vector_peak.read_bandwidth(t), read_before[str(t)]) for t in threads}
    macs = step_macs(args.layers)
    step_bytes = sum(
        t.numel() * t.element_size() for g in products for t in (g.q, g.d, g.m) if t is not None
    )  # the tiles and their float16 constants
    roofs = {
        n: {
            str(t): {str(r): vector_peak.roof_ms(n, r, *macs, peaks[str(t)], step_bytes, read[str(t)]) for r in rows}
            for t in threads
        }
        for n in names
    }
    result = {
        "cpu": cpu_model(),
        "kernel_path": path.as_dict(),
        "layers": args.layers,
        "ms_per_step": ms,
        "macs_per_row": {"4bit": macs[0], "8bit": macs[1]},
        "peak_macs_per_s": peaks,
        "step_bytes": step_bytes,
        "read_bytes_per_s": read,
        **{key: _part(roofs, i) for i, key in enumerate(("roof_ms", "roof_bound"))},
    }
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"group_kernels_{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(result, indent=1))
    print(
        f"\n{args.layers} layers' products and the LM head ({step_bytes / 1e6:.0f} MB of groups), ms per step, best of "
        f"{args.repeats}; {path.cpu} ({path.cpu_id})\n"
    )
    print("| version, threads | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for n in names:
        for t in threads:
            cells = []
            for r in rows:
                took, roof = ms[n][str(t)][str(r)], roofs[n][str(t)][str(r)]
                cells.append(
                    f"{took:.1f}"
                    + ("" if roof is None else f" ({roof[0]:.1f} {roof[1][0]}, {100 * roof[0] / took:.0f}%)")
                )
            print(f"| {n}, {t} | " + " | ".join(cells) + " |")
    print(
        "\n(in brackets: the roof, ms, the longer of the step's multiply-adds at the measured peak of the version's "
        "instruction on that many cores (a) and its weights' bytes read once at the rate those cores read memory (m); "
        "the share of it reached)\n\npeak multiply-adds per second (G), by instruction and cores: "
        + "; ".join(
            f"{t} core(s): " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peaks[str(t)].items()) for t in threads
        )
        + "\nmemory read (GB/s), by cores: "
        + ", ".join(f"{t} core(s) {read[str(t)] / 1e9:.1f}" for t in threads)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
