"""Triton entry point of the disaggregated front model; logic in ``backend.triton.front_model``."""

from backend.triton.front_model import TritonPythonModel  # noqa: F401
