"""``triton-disagg bench`` (perf/cli.py): the subcommands it lists are modules with
``main(argv)``, a run is recorded in the results envelope with its command, commit, machine,
exit code and the files it wrote, a help text is not recorded, and perf/ imports nothing from
tests/."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from perf import cli
from perf.lib import results

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in (
        "engine",
        "serve",
        "transfer",
        "sweep",
        "multiturn",
        "cpp-baseline",
        "genai-perf",
        "aiperf",
        "perf-analyzer",
        "autoscale",
    ):
        assert f"\n  {name} " in out, name


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_each_subcommand_is_a_module_with_main_argv(name):
    module = cli.SUBCOMMANDS[name][0]
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    tree = ast.parse(Path(spec.origin).read_text())
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert mains, f"{module} has no main()"
    assert [a.arg for a in mains[0].args.args] == ["argv"], f"{module}.main must take argv"


@pytest.fixture
def fake_bench(monkeypatch, tmp_path):
    """A subcommand ``fake`` whose main writes one JSON result, under a results folder in tmp_path."""
    out = tmp_path / "results"
    module = types.ModuleType("fake_bench_module")

    def main(argv):
        if "--fail" in argv:
            raise SystemExit(3)
        if "--help" in argv:
            raise SystemExit(0)
        out.mkdir(exist_ok=True)
        (out / "fake_result.json").write_text(json.dumps({"tokens_per_s": 42.0, "argv": argv}))
        if "--reproduce" in argv:
            print("reproduce:", results.command_line("perf.fake"))
        if "--table" in argv:
            print("noise\nSpeed per thread count:\n| threads | tok/s |\n|---|---|\n| 1 | 42 |\ndone")
            print("Then, after a blank line:\n\n| b | c |\n|---|---|\n| 2 | 3 |\n\n\n| orphan |\n|---|")
            (out / "fake_result.json").unlink()
        return 0

    module.main = main
    monkeypatch.setitem(sys.modules, "fake_bench_module", module)
    monkeypatch.setitem(cli.SUBCOMMANDS, "fake", ("fake_bench_module", "a fake benchmark"))
    monkeypatch.setenv(results.RESULTS_ENV, str(out))
    monkeypatch.delenv(results.RUNS_ENV, raising=False)
    return out


def test_a_run_is_recorded_with_command_commit_machine_and_figures(fake_bench):
    assert cli.main(["fake", "--rate", "2"]) == 0
    run = results.latest("fake")
    assert run is not None
    assert run["command"] == ["triton-disagg", "bench", "fake", "--rate", "2"]
    assert run["exit_code"] == 0 and run["schema"] == results.SCHEMA
    assert len(run["commit"]) >= 40 or run["commit"] == "unknown"
    assert run["machine"]["cores"] >= 1 and run["machine"]["cpu"] and run["machine"]["torch"]
    (name,) = run["files"]
    assert name.endswith("fake_result.json")
    assert run["figures"][name] == {"tokens_per_s": 42.0, "argv": ["--rate", "2"]}


def test_an_envelope_keeps_summaries_not_per_request_records(fake_bench):
    big = {"stats": {"ttft_p50": 0.5}, "records": [{"token_times": list(range(50))} for _ in range(400)]}
    kept = results.keepable(big)
    assert kept == {"stats": {"ttft_p50": 0.5}}
    assert results.keepable({"a": 1}) == {"a": 1}


def test_a_benchmark_names_the_command_that_reproduces_it(fake_bench, capsys, monkeypatch):
    assert cli.main(["fake", "--reproduce", "--rate", "2"]) == 0
    assert "reproduce: triton-disagg bench fake --reproduce --rate 2\n" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["perf/fake.py", "--rate", "3 4"])  # run directly, not recorded
    assert results.command_line("perf.fake") == "python -m perf.fake --rate '3 4'"


def test_a_failed_run_is_recorded_with_its_exit_code(fake_bench):
    assert cli.main(["fake", "--fail"]) == 3
    run = results.latest("fake")
    assert run is not None and run["exit_code"] == 3 and run["files"] == []


def test_a_help_text_is_not_a_run(fake_bench):
    assert cli.main(["fake", "--help"]) == 0
    assert results.latest("fake") is None


def test_an_unknown_subcommand_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        cli.main(["no-such-bench"])
    assert "no-such-bench" in capsys.readouterr().err


def test_perf_imports_nothing_from_tests():
    offenders = []
    for path in sorted((ROOT / "perf").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not offenders, offenders


def test_the_report_is_generated_from_the_newest_good_run_of_each(fake_bench, monkeypatch, tmp_path):
    from perf.lib import report

    assert cli.main(["fake", "--rate", "1"]) == 0
    assert cli.main(["fake", "--fail"]) == 3
    out = tmp_path / "REPORT.md"
    subcommands = {"fake": cli.SUBCOMMANDS["fake"], "engine": cli.SUBCOMMANDS["engine"]}
    text = report.generate(subcommands, results.runs_dir(), out)
    assert out.read_text() == text
    assert "## fake: a fake benchmark" in text
    assert "`triton-disagg bench fake --rate 1`" in text  # the good run, not the failed one
    assert "1 later run(s) failed" in text
    assert "| `tokens_per_s` | 42 |" in text
    assert "| `engine` | not run yet | | |" in text


def test_a_printed_table_is_kept_and_reported_when_no_file_was_written(fake_bench, tmp_path):
    from perf.lib import report

    assert cli.main(["fake", "--table"]) == 0
    run = results.latest("fake")
    assert run is not None and "| 1 | 42 |" in run["output"] and not run["files"]
    text = report.generate({"fake": cli.SUBCOMMANDS["fake"]}, results.runs_dir(), tmp_path / "R.md")
    assert "Speed per thread count:\n\n| threads | tok/s |\n|---|---|\n| 1 | 42 |" in text
    assert "Then, after a blank line:\n\n| b | c |" in text
    assert "| 2 | 3 |\n\n| orphan |" in text  # two blank lines: no caption
    assert "noise" not in text


def test_a_flag_that_switches_the_measurement_keeps_a_section_of_its_own(fake_bench, tmp_path):
    from perf.lib import report

    assert cli.main(["fake", "--rate", "1"]) == 0
    assert cli.main(["fake", "--routing", "--rate", "2"]) == 0
    assert cli.main(["fake", "--routing", "--fail"]) == 3
    fake = {"fake": cli.SUBCOMMANDS["fake"]}
    text = report.generate(fake, results.runs_dir(), tmp_path / "R.md", {"fake": ("--routing",)})
    plain, routing = text.index("## fake: a fake benchmark"), text.index("## fake --routing: a fake benchmark")
    assert plain < routing
    assert "`triton-disagg bench fake --rate 1`" in text[plain:routing]  # not replaced by the newer variant
    assert "`triton-disagg bench fake --routing --rate 2`" in text[routing:]
    assert "1 later run(s) failed" in text[routing:] and "later run(s) failed" not in text[plain:routing]
    assert "[`fake`](#" in text and "[`fake --routing`](#" in text


def test_report_subcommand_writes_the_file(fake_bench, tmp_path):
    out = tmp_path / "R.md"
    assert cli.main(["report", "--runs", str(tmp_path / "none"), "--out", str(out)]) == 0
    assert out.read_text().startswith("# Measured figures")


def test_markdown_headings_are_demoted_under_the_section():
    from perf.lib import report

    assert report.demote("# Title\n\ntext\n## Sub") == "### Title\n\ntext\n#### Sub"
    flat = report.flatten({"a": {"b": 1.5, "c": [1, 2]}, "s": "x"})
    assert flat == [("a.b", 1.5), ("a.c[0]", 1), ("a.c[1]", 2), ("s", "x")]


def test_the_index_links_to_each_section_as_github_anchors_it():
    from perf.lib import report

    assert (
        report._anchor("perf-analyzer: NVIDIA perf_analyzer --streaming")
        == "perf-analyzer-nvidia-perf_analyzer---streaming"
    )
    assert report._anchor("multiturn --routing: multi-turn chat") == "multiturn---routing-multi-turn-chat"
