"""Load this folder's JSONL files for the lm-eval tasks beside them (``custom_dataset`` in the
task YAMLs), so the tasks work from any working directory and never touch the Hugging Face Hub."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(file: str, **_metadata):
    """A DatasetDict with one ``test`` split: the rows of ``file`` (a JSONL file in this folder)."""
    import datasets  # lm-eval's dependency, present in its venv only

    rows = [json.loads(line) for line in (HERE / file).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
