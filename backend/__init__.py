"""triton-disagg: disaggregated prefill and decode for LLM serving on NVIDIA Triton (Python backend).

Importing it applies ``TRITON_DISAGG_CPU`` (``backend.engine.cpu_kernels.apply_cpu_mask``) before any
torch op of the process runs."""

from backend.engine.cpu_kernels import apply_cpu_mask

apply_cpu_mask()
