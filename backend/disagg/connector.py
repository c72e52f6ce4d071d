"""The KV connector seam, in the style of vLLM's v1 KV connector: what the serving workers and
the engine ask of whatever moves KV between instances. Each role has a *scheduler side*
(requests: what will arrive, when a request may run, whether its pages may be freed now or
later) and the sending role a *worker side* (the engine's :class:`KVStepListener`: which
pages a step's chunks complete, a layer's KV is written: post it).

The NIXL implementation is ``backend/disagg/nixl_connector.py``; another transport would
implement these two classes and nothing above this layer would change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from backend.engine.outputs import EngineOutput
from backend.engine.protocol import DeviceMark
from backend.engine.scheduler import StepBatch

# (req_id, ok, error) once the pages a request sent from may be freed (every write done or stopped)
FreeableCallback = Callable[[str, bool, str | None], None]
# (req_id, ok, error, (hidden, logits) or None) once a request's KV has arrived or cannot
ReadyCallback = Callable[[str, bool, str | None, tuple[torch.Tensor, torch.Tensor] | None], None]
# (req_id) once no late write can land in a failed request's pages any more
ReleaseCallback = Callable[[str], None]


@dataclass(frozen=True)
class SendRequest:
    """A prefill that a receiver asked for: where its KV goes."""

    req_id: str
    peer: str
    generation: int
    slot: int | None
    n_tokens: int
    dst_pages: list[int]  # for the prompt's pages first_page, first_page + 1, ...
    first_page: int = 0


@dataclass(frozen=True)
class ReceiveTicket:
    """What the receiver expects for one request; the sender needs generation and slot."""

    generation: int
    slot: int | None
    n_pages: int
    expected_writes: int


class PeerAgent(Protocol):
    """What the messenger needs from a connector for the handshake: this instance's fabric
    description, and taking a peer's (validated: a layout mismatch is refused, naming it)."""

    def handshake_payload(self) -> dict: ...
    def add_peer(self, payload: dict) -> str: ...


class KVSender(ABC):  # also the engine's KVStepListener (its worker side)
    """Prefill role. Scheduler side: :meth:`add_request`, :meth:`request_finished`,
    :meth:`cancel`. Worker side: :meth:`step_scheduled`, :meth:`layer_written` (engine thread)."""

    @abstractmethod
    def add_request(self, request: SendRequest) -> None:
        """Take a request before its prefill is submitted (ValueError: refused, with the reason)."""

    @abstractmethod
    def request_finished(self, output: EngineOutput, on_freeable: FreeableCallback) -> None:
        """The engine finished the request (prefill done, or failed/aborted): send what is left
        (the last hidden state and logits) or stop; ``on_freeable`` fires when its pages may be
        freed, i.e. no write reads them any more ("free later", never "free now" while in flight)."""

    @abstractmethod
    def cancel(self, req_id: str, reason: str) -> None:
        """Stop sending for a request (receiver cancelled, peer lost, instance down)."""

    @abstractmethod
    def step_scheduled(self, batch: StepBatch) -> None:
        """Engine thread, before a step with prefill-only chunks: which pages it completes."""

    @abstractmethod
    def layer_written(self, layer: int, batch: StepBatch, written: DeviceMark) -> None:
        """Engine thread, right after each layer queued the step's KV write (``KVStepListener``):
        post those pages once ``written`` is done, never blocking the engine thread."""

    @abstractmethod
    def stats(self) -> dict: ...

    @abstractmethod
    def close(self) -> None: ...


class KVReceiver(ABC):
    """Decode role. :meth:`num_external_tokens` (how many tokens' KV arrives from elsewhere),
    :meth:`expect` (pages are reserved: wait for those writes; the request may run when
    ``on_ready`` fires), :meth:`cancel`."""

    @abstractmethod
    def num_external_tokens(self, prompt_len: int) -> int: ...

    @abstractmethod
    def expect(
        self,
        req_id: str,
        n_tokens: int,
        source,
        on_ready: ReadyCallback,
        on_release: ReleaseCallback,
        first_page: int = 0,
    ) -> ReceiveTicket:
        """Wait for the KV of tokens ``[first_page * page_size, n_tokens)`` (the pages before
        ``first_page`` are here already)."""

    @abstractmethod
    def started(self, req_id: str, generation: int) -> None:
        """The sender began the request: its queueing there is over."""

    @abstractmethod
    def cancel(self, req_id: str, reason: str) -> None: ...

    @abstractmethod
    def stats(self) -> dict: ...

    @abstractmethod
    def observations(self) -> dict[str, list[float]]:
        """Per-request latencies measured since the last call (``prefill_queue_time_seconds``:
        asked until the sender started; ``kv_transfer_time_seconds``: started until the last
        write landed), forgotten once handed over."""

    @abstractmethod
    def close(self) -> None: ...
