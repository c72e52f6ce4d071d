"""Triton entry point of a prefill (context) instance; logic in ``backend.triton.prefill_model``."""

from backend.triton.prefill_model import TritonPythonModel  # noqa: F401
