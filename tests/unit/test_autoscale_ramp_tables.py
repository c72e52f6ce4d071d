"""The markdown ``triton-disagg bench autoscale`` prints (and the report keeps): the runs side by
side, each run's scaling changes and its prediction errors."""

from perf.autoscale_ramp import tables


def _run(name: str, changes: list[dict]) -> dict:
    return {
        "name": name,
        "requests": 10,
        "failed": 0,
        "slo_met": 9,
        "attainment": 0.9,
        "goodput_per_s": 0.2,
        "goodput_per_instance_s": 0.1,
        "ttft_p50_s": 1.0,
        "ttft_p90_s": None,
        "itl_p90_s": 0.12,
        "mean_instances": 2.0,
        "changes": changes,
        "predictions": {"rate": {"intervals": 4, "median_rel_error": 0.5, "within_25pct": 1}, "itl_p90": {}},
    }


def test_tables_are_markdown_with_a_row_per_run_and_a_row_per_change():
    changes = [
        {"t": 100.0, "role": "decode", "from": 1, "to": 2, "reason": "TTFT p90 | high"},
        {"t": 130.0, "role": "decode", "from": 2, "to": 1, "reason": "calm"},
    ]
    report = {"phases": "10:0.1", "requests": 10, "slo": {"ttft_s": 3.0, "itl_p90_s": 0.3}}
    report["runs"] = [_run("autoscaled", changes), _run("fixed 1P:1D", [])]
    md = tables(report)
    lines = md.splitlines()
    header = lines.index(
        "| deployment | mean instances | SLO attainment | met / s | goodput per instance-second "
        "| TTFT p50 / p90 (s) | ITL p90 (s) | failed |"
    )
    assert lines[header + 1] == "|---|---|---|---|---|---|---|---|"
    assert lines[header + 2] == "| autoscaled | 2.00 | 90.0 % (9 of 10) | 0.200 | 0.1000 | 1.00 / - | 0.120 | 0 |"
    assert lines[header + 3].startswith("| fixed 1P:1D |")
    assert "| 0 | decode 1 -> 2 | TTFT p90 / high |" in lines  # a | in a reason does not split the row
    assert "| 30 | decode 2 -> 1 | calm |" in lines
    assert "fixed 1P:1D: what the autoscaler changed" not in md  # no changes, no table
    assert "| arrival rate | 4 | 50 % | 1 |" in lines and "| ITL p90 | 0 | - | 0 |" in lines
