"""The benchmark tools work end to end on a tiny load (figures themselves live in perf/)."""

from perf import compare_modes
from perf.lib import loadgen


def test_loadgen_records_and_report_pieces(aggregated_server, tokenizer, tmp_path):
    w = loadgen.Workload(rate=4.0, duration_s=1.0, prompt_tokens=(24, 40), output_tokens=(5, 6), seed=3)
    records, wall = loadgen.run(aggregated_server.grpc_url, tokenizer, w)
    assert records and all(r.error is None for r in records)
    assert all(r.n_tokens == r.max_tokens and len(r.token_times) == r.n_tokens for r in records)
    assert all(24 - 2 <= r.prompt_tokens <= 40 for r in records)
    assert loadgen.plan_requests(tokenizer, w)[0][1] == loadgen.plan_requests(tokenizer, w)[0][1]  # seeded
    s = compare_modes.summarize(records, wall)
    assert s["completed"] == len(records) and s["itl_p50"] > 0 and s["ttft_p50"] > 0
    plots = compare_modes.plot({"aggregated": records, "disagg": records}, tmp_path, "t")
    assert all(p.stat().st_size > 1000 for p in plots)
