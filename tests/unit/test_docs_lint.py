"""The user documentation's limits (README.md, docs/*.md): short pages, no history, every command
block run by a test or marked as not run with its reason (the convention: ``tests/doc_blocks.py``),
and every test, file and page it points to present."""

from __future__ import annotations

import re

import pytest

from tests.doc_blocks import ROOT, all_blocks, doc_files

README_MAX_LINES = 300
PAGE_MAX_LINES = 400
# a dated entry: an ISO date, or a "2026-12-06 evening"-style stamp; history belongs in git and perf/history/
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# `tests/.../test_x.py::test_name`, or `ti/test_x.py::test_name` (the README's shorthand for tests/integration/)
TEST_REF = re.compile(r"`(?P<file>(?:tests/|ti/)[\w/]+\.py)(?:::(?P<name>\w+))?")
LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_at_most_300_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: move the depth to docs/)"


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_each_docs_page_is_at_most_400_lines(page):
    n = len(page.read_text().splitlines())
    assert n <= PAGE_MAX_LINES, f"{page.name} has {n} lines (at most {PAGE_MAX_LINES})"


def test_there_are_docs_pages():
    assert len(doc_files()) > 1, "docs/ holds no page"


def test_no_dated_entries():
    dated = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in doc_files()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if DATED.search(line)
    ]
    assert not dated, "dated lines (history goes to git and perf/history/):\n" + "\n".join(dated)


def test_every_command_block_is_run_or_says_why_not():
    bad = []
    for b in all_blocks():
        if not b.is_command:
            continue
        if b.marker == "not run" and len(b.reason.split()) < 3:
            bad.append(f"{b.where}: 'not run' needs a reason of a few words, got {b.reason!r}")
        elif b.marker not in ("", "not run", "run: deployment"):
            bad.append(f"{b.where}: unknown marker {b.marker!r} (see tests/doc_blocks.py)")
    assert not bad, "\n".join(bad)


def test_one_block_starts_the_deployment_the_others_query():
    starts = [b.where for b in all_blocks() if b.is_deployment]
    assert len(starts) == 1, f"expected one <!-- run: deployment --> block, found {starts}"
    assert [b for b in all_blocks() if b.is_runnable], "no runnable command block"


def test_markers_stand_before_command_blocks_only():
    stray = [b.where for b in all_blocks() if b.marker and not b.is_command]
    assert not stray, f"run / not-run markers before blocks that hold no commands: {stray}"


def test_every_test_named_exists():
    missing = []
    for path in doc_files():
        for m in TEST_REF.finditer(path.read_text()):
            file = ROOT / m.group("file").replace("ti/", "tests/integration/", 1)
            if not file.exists():
                missing.append(f"{path.name}: {m.group(0)} (no file)")
            elif m.group("name") and not re.search(rf"^def {m.group('name')}\(", file.read_text(), re.M):
                missing.append(f"{path.name}: {m.group(0)} (no such test)")
    assert not missing, "\n".join(missing)


def test_every_relative_link_reaches_a_file():
    broken = [
        f"{path.relative_to(ROOT)}: {m.group('target')}"
        for path in doc_files()
        for m in LINK.finditer(path.read_text())
        if "://" not in m.group("target") and not (path.parent / m.group("target")).exists()
    ]
    assert not broken, "\n".join(broken)


def test_the_convention_reads_markers_and_rewrites_only_the_documented_ports(tmp_path):
    from tests.doc_blocks import blocks, with_ports

    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```bash\ncurl localhost:8000/x\n```\n\n<!-- not run: needs two hosts -->\n\n```sh\nssh b\n```\n"
        "<!-- run: deployment -->\n```bash\nserve --http-port 8000\n```\n<!-- odd -->\n```python\nprint(1)\n```\n"
        "```\n+-- picture --+\n```\n"
    )
    found = blocks(page)
    assert [(b.lang, b.marker, b.reason) for b in found] == [
        ("bash", "", ""),
        ("sh", "not run", "needs two hosts"),
        ("bash", "run: deployment", ""),
        ("python", "<!-- odd -->", ""),
        ("", "", ""),
    ]
    assert [b.is_runnable for b in found] == [True, False, False, False, False]
    assert found[0].text == "curl localhost:8000/x\n" and found[2].is_deployment
    ports = {"http": 31000, "grpc": 31001, "metrics": 31002, "openai": 31009}
    assert with_ports("localhost:8000 --grpc-port 8001 :8002/m 9000 80001 1.8000 9400", ports) == (
        "localhost:31000 --grpc-port 31001 :31002/m 31009 80001 1.8000 9400"
    )
