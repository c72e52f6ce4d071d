"""``scripts/gpu_check.sh --device cpu --quick`` (the GPU check, on the CPU with tiny shapes) runs
end to end and its JSON says every check passed, so the script cannot rot between the rare
sessions that have a GPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_script_on_cpu_quick(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["quick"] is True
    assert set(summary["sections"]) == {"device_marks", "engine_vs_transformers", "disagg_transfer", "figures"}
    assert all(s.get("ok") for s in summary["sections"].values()), summary

    engine = json.loads((out / "engine_vs_transformers.json").read_text())
    assert engine["mismatched"] == {} and len(engine["prompt_lengths"]) == 3
    transfer = json.loads((out / "disagg_transfer.json").read_text())
    assert transfer["mem_kind"] == "DRAM" and len(transfer["requests"]) == 2
    assert all(r["bytes_equal"] and r["tokens_equal_aggregated"] and r["bytes"] > 0 for r in transfer["requests"])
    figures = json.loads((out / "figures.json").read_text())
    assert figures["prefill_tokens_per_s"] > 0 and set(figures["decode_itl"]) == {"1", "4"}
    for mode in ("after_prefill", "layer_by_layer"):
        assert figures["transfer"][mode]["bytes_equal"] and figures["transfer"][mode]["bytes"] > 0
    assert figures["transfer"]["after_prefill"]["gb_per_s"] > 0
