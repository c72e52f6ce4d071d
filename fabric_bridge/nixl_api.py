"""NIXL's Python API, from whichever CUDA variant of the wheel is installed (``nixl-cu12`` here
and in CI; ``nixl-cu13`` on a CUDA 13 machine)."""

from __future__ import annotations

try:
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:  # pragma: no cover - only where the CUDA 13 wheel is installed instead
    from nixl_cu13._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

__all__ = ["nixl_agent", "nixl_agent_config", "nixl_thread_sync_t"]
