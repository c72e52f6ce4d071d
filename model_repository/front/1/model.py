"""Triton entry point of the disaggregated front model; logic in ``backend.triton_front_model``."""
from backend.triton_front_model import TritonPythonModel  # noqa: F401
