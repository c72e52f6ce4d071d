"""Triton entry point of a decode (generation) instance; logic in ``backend.triton_model`` (role decode)."""
from backend.triton_model import TritonPythonModel  # noqa: F401
