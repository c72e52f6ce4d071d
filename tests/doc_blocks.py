"""The code blocks of the user documentation (README.md, docs/*.md) and what each one is for the tests.

The convention, which ``tests/unit/test_docs_lint.py`` enforces and
``tests/integration/test_docs_commands.py`` runs:

* A fenced block whose language is one of :data:`COMMAND_LANGUAGES` (``bash``, ``sh``, ``shell``,
  ``console``, ``python``) holds commands. Any other block (a picture, a table of output) holds none.
* A command block is **runnable** by default: the integration test runs it, from the repository
  root, against one real deployment, and fails when it exits non-zero or prints nothing.
* ``<!-- not run: REASON -->`` on the last non-blank line before the fence marks a block that the
  test does not run; the reason says why (several hosts, a GPU, minutes of benchmarking, a package
  install) and, where there is one, which test covers it.
* ``<!-- run: deployment -->`` marks the one block (in all the pages) that starts the deployment
  the runnable blocks query; the test starts it in the background and stops it with Ctrl-C.
* Runnable blocks use the default ports (:data:`DOC_PORTS`: HTTP 8000, gRPC 8001, metrics 8002,
  the OpenAI API 9000); the test rewrites them to free ports (:func:`with_ports`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND_LANGUAGES = ("bash", "sh", "shell", "console", "python")
DOC_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>.*?)\s*-->$")
RUN = re.compile(r"^<!--\s*run:\s*(?P<what>.*?)\s*-->$")
FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text and its marker."""

    path: Path
    line: int  # the opening fence's line, 1-based
    lang: str
    text: str
    marker: str  # "" (no marker), "not run", "run: <what>", or the malformed comment itself
    reason: str = ""  # a "not run" block's reason

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def is_command(self) -> bool:
        return self.lang in COMMAND_LANGUAGES

    @property
    def is_deployment(self) -> bool:
        return self.marker == "run: deployment"

    @property
    def is_runnable(self) -> bool:
        return self.is_command and self.marker == ""


def doc_files() -> list[Path]:
    """The user documentation: the README and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced code block of one Markdown file, in order, with the marker before it."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group("fence"), m.group("lang").lower(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker, reason = "", ""
        if before.startswith("<!--"):
            if n := NOT_RUN.match(before):
                marker, reason = "not run", n.group("reason")
            elif r := RUN.match(before):
                marker = f"run: {r.group('what')}"
            else:
                marker = before
        found.append(Block(path, start + 1, lang, "\n".join(body) + "\n", marker, reason))
    return found


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path)]


def with_ports(text: str, ports: dict[str, int]) -> str:
    """``text`` with each documented default port (:data:`DOC_PORTS`) replaced by ``ports``' one."""
    swap = {str(DOC_PORTS[name]): str(port) for name, port in ports.items()}
    return re.sub(r"(?<![\d.])(" + "|".join(swap) + r")(?!\d)", lambda m: swap[m.group(1)], text)
