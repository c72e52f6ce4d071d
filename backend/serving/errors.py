"""How an error's kind travels in a Triton error message: ``[kind] message``. The kind is the
:class:`ErrorKind` value, written by :func:`format_error` and read back into the enum by
:func:`parse_error` (a structured prefix, not a search in the text), so the front model can
route on it."""

from __future__ import annotations

import re

from backend.engine.outputs import ErrorKind

_TAGGED = re.compile(r"^\[(?P<kind>[a-z_]+)\] (?P<message>.*)$", re.S)


def format_error(kind: ErrorKind, message: str) -> str:
    return f"[{kind.value}] {message}"


def parse_error(text: str) -> tuple[ErrorKind | None, str]:
    """(kind, message) of a message made by :func:`format_error`; (None, text) otherwise."""
    m = _TAGGED.match(text or "")
    if m is None:
        return None, text
    try:
        return ErrorKind(m["kind"]), m["message"]
    except ValueError:
        return None, text
