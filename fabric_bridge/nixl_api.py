"""Where NIXL's Python API comes from: loaded lazily, replaceable for tests.

Importing this module (or ``fabric_bridge.agent``, or the connector above it) does not import
NIXL: :func:`load` does, when the first :class:`~fabric_bridge.agent.FabricAgent` starts. It
takes whichever CUDA variant of the wheel is installed (``nixl-cu12`` here and in CI;
``nixl-cu13`` on a CUDA 13 machine). :func:`install` puts another implementation in its place
for every agent created afterwards, wherever it is created (tests install an in-process fake,
``tests/fake_nixl.py``); ``install(None)`` goes back to the real one.

An implementation is any object (a module, usually) with the three names fabric_bridge uses:
``nixl_agent(name, config)``, ``nixl_agent_config(enable_prog_thread=, backends=, sync_mode=)``
and ``nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT``.

Lock discipline: one small lock guards the installed/loaded implementation; it is held only
while reading or swapping that reference or importing NIXL, never while NIXL runs.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Protocol

_VARIANTS = ("nixl_cu12._api", "nixl_cu13._api")


class NixlImplementation(Protocol):
    """What fabric_bridge needs of NIXL's ``_api`` module."""

    nixl_agent: Any
    nixl_agent_config: Any
    nixl_thread_sync_t: Any


class Releasable(Protocol):
    """A NIXL handle (prepped descriptor list, xfer) that must be released."""

    def release(self) -> None: ...


_lock = threading.Lock()
_installed: NixlImplementation | None = None  # set by install(): used instead of real NIXL
_real: NixlImplementation | None = None  # real NIXL, once imported


def install(impl: NixlImplementation | None) -> NixlImplementation | None:
    """Use ``impl`` for every agent created from now on (None: real NIXL again). Returns the
    implementation installed before, so a caller can put it back."""
    global _installed
    with _lock:
        previous, _installed = _installed, impl
        return previous


def load() -> NixlImplementation:
    """The implementation agents use now: the installed one, else real NIXL (imported on the
    first call; ImportError naming the wheels when neither variant is installed)."""
    global _real
    with _lock:
        if _installed is not None:
            return _installed
        if _real is None:
            errors = []
            for name in _VARIANTS:
                try:
                    _real = importlib.import_module(name)
                    break
                except ImportError as e:
                    errors.append(f"{name}: {e}")
            else:
                raise ImportError("NIXL is not installed (pip install nixl-cu12 or nixl-cu13): " + "; ".join(errors))
        return _real
