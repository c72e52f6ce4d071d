"""Triton entry point of a decode (generation) instance; logic in ``backend.triton.llm_model`` (role decode)."""

from backend.triton.llm_model import TritonPythonModel  # noqa: F401
