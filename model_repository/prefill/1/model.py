"""Triton entry point of a prefill (context) instance; logic in ``backend.triton_prefill_model``."""
from backend.triton_prefill_model import TritonPythonModel  # noqa: F401
