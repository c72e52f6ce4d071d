"""The markdown ``triton-disagg bench migration`` prints: migration on against off."""

import math

from perf.bench_migration import table


def _side(moved: int, failed: int, ok: int, requests: int, kinds: dict) -> dict:
    gap = {"streams_moved": moved, "streams_failed": failed, "gap_p50_s": 2.0, "gap_p99_s": 2.5, "gap_max_s": 2.6}
    gap["streams_on_killed_instance"] = 10
    gap["inter_token_median_s"] = 0.05 if moved else math.nan
    put = {"kills": 2, "ok": ok, "requests": requests, "failed_by_kind": kinds}
    put |= {"goodput_req_s": ok / 100, "goodput_tokens_s": ok * 0.64}
    return {"gap": gap, "goodput": put}


def test_on_against_off_with_the_gap_and_the_goodput_ratio():
    out = {
        "args": {"rounds": 5, "seconds": 180, "kill_every": 60},
        "migration_on": _side(10, 0, 55, 55, {}),
        "migration_off": _side(0, 10, 50, 54, {"out_of_service": 4}),
    }
    lines = table(out).splitlines()
    assert "| streams on the killed instance (5 rounds) | 10 | 10 |" in lines
    row = "| after the kill: streams failed; streams that paused (> 5x their median gap) and finished |"
    assert f"{row} 0 failed; 10 paused and finished | 10 failed; 0 paused and finished |" in lines
    assert "| the longest pause in those streams: p50 / p99 / max | 2.00 s / 2.50 s / 2.60 s | - |" in lines
    assert "| median inter-token time of the same streams | 50 ms | - |" in lines
    assert "| goodput ratio | 1.10x | 1x |" in lines
    assert any("(50/54 ok; 4 out_of_service)" in line and "(55/55 ok; none failed)" in line for line in lines)
