"""Triton Python-backend entry point of the aggregated ``llm`` model.

All logic lives in ``backend.triton.llm_model``; the repository root is on PYTHONPATH
(``triton-disagg serve`` sets it).
"""

from backend.triton.llm_model import TritonPythonModel  # noqa: F401
