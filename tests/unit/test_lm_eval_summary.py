"""The side-by-side summary of ``triton-disagg bench lm-eval``: responses compared across modes
(lm-eval logs loglikelihoods as strings) and the scores table."""

from perf import lm_eval_run


def _mc(ll: str, greedy: str = "False") -> dict:
    return {"doc_id": 0, "arguments": {"gen_args_0": {}}, "filtered_resps": [[ll, greedy]]}


def test_loglikelihoods_agree_within_the_tolerance_and_texts_exactly():
    agg = {"samples": {"td_mc": [_mc("-4.3559")], "td_gen": [{"doc_id": 0, "filtered_resps": [" grass"]}]}}
    close = {"samples": {"td_mc": [_mc("-4.3562")], "td_gen": [{"doc_id": 0, "filtered_resps": [" grass"]}]}}
    far = {"samples": {"td_mc": [_mc("-4.3700")], "td_gen": [{"doc_id": 0, "filtered_resps": [" gras"]}]}}
    assert lm_eval_run.agreement({"aggregated": agg, "disagg": close}) == {"td_gen": True, "td_mc": True}
    assert lm_eval_run.agreement({"aggregated": agg, "disagg": far}) == {"td_gen": False, "td_mc": False}
    # a flipped is-greedy flag is a disagreement even with equal loglikelihoods
    assert lm_eval_run.agreement({"a": agg, "b": {"samples": {"td_mc": [_mc("-4.3559", "True")]}}}) == {"td_mc": False}


def test_one_mode_or_a_failed_mode_compares_nothing():
    assert lm_eval_run.agreement({"aggregated": {"samples": {"td_mc": [_mc("-1")]}}}) == {}
    assert lm_eval_run.agreement({"aggregated": {"samples": {"td_mc": [_mc("-1")]}}, "disagg": {"error": "x"}}) == {}


def test_table_has_a_row_per_mode_and_names_a_failure():
    ok = {"results": {"td_mc": {"acc,none": 0.875}, "td_ppl": {"word_perplexity,none": 59.797}}, "wall_s": 30.0}
    md = lm_eval_run.table({"aggregated": ok, "disagg": {"error": "RuntimeError: server exited"}})
    lines = md.splitlines()
    assert len(lines) == 4 and lines[1].count("|---") == len(lm_eval_run.COLUMNS) + 2
    assert lines[2].startswith("| aggregated | 0.875 |") and "59.8" in lines[2] and lines[2].endswith("| 30.0 |")
    assert lines[3].startswith("| disagg | - |") and "server exited" in lines[3]
