"""The life of a disaggregated request, per role: its states, the events that move it, and the one
transition table each role follows. Every state change of a decode or prefill request happens
through :meth:`RequestState.apply` on its worker's loop thread; an event the table does not allow
in the current state raises :class:`IllegalTransition` (the worker logs it and drops the event).
Who raises each event is in ``backend/README.md``.

Decode role (the decode instance allocates first, then asks for the prefill)::

    QUEUED --KV_NEEDED--> WAITING_KV --KV_LANDED--> RUNNING --ENGINE_FINISHED--> FINISHED
       |  --LOCAL------------------------------------^
       |  --ENGINE_FINISHED--> FINISHED
    WAITING_KV --NO_PREFILL--> FINISHED
    WAITING_KV --KV_FAILED--> RELEASING --KV_RELEASED--> FINISHED
    WAITING_KV --CANCEL / ENGINE_FINISHED--> CANCELLING --KV_FAILED--> RELEASING
                                             CANCELLING --KV_LANDED--> FINISHED
    RELEASING --RECOMPUTE--> RECOVERING --KV_RELEASED--> WAITING_KV (asks another prefill
                                                         instance, or --LOCAL--> RUNNING)

RELEASING, CANCELLING and RECOVERING hold the request's pages: a write may still land in them until the
receiver says none can (KV_RELEASED) or the KV landed whole.

Prefill role::

    QUEUED --STARTED--> RUNNING --ENGINE_FINISHED--> SENDING --FREEABLE--> FINISHED
    QUEUED --ENGINE_FINISHED--> SENDING
"""

from __future__ import annotations

import enum


class DecodeState(enum.Enum):
    QUEUED = "queued"  # in the engine's admission queue (waiting for pages)
    WAITING_KV = "waiting_kv"  # has pages; a prefill instance computes and sends its KV
    RUNNING = "running"  # decoding (or prefilling here: conditional disaggregation)
    CANCELLING = "cancelling"  # ended while waiting for KV; the receiver's verdict is pending
    RELEASING = "releasing"  # ended; its pages wait until no late write can land
    RECOVERING = "recovering"  # its KV load failed; it waits until no late write can land, then recomputes
    FINISHED = "finished"  # pages freed or owned by the engine again; the record is dropped


class DecodeEvent(enum.Enum):
    KV_NEEDED = "kv_needed"  # engine (its KV loader): pages allocated, the prompt's KV comes from elsewhere
    LOCAL = "local"  # engine (its KV loader): pages allocated, computed here
    NO_PREFILL = "no_prefill"  # worker: no prefill instance can take it
    KV_LANDED = "kv_landed"  # fabric (completion tracker): every write and the meta block landed
    KV_FAILED = "kv_failed"  # fabric: timeout, cancel, sender stopped
    KV_RELEASED = "kv_released"  # fabric: no write can land in the pages any more
    PREFILL_STARTED = "prefill_started"  # messenger: the prefill instance began it
    PREFILL_FAILED = "prefill_failed"  # messenger: the prefill instance refused or failed it, or was lost
    CANCEL = "cancel"  # client (session) or admission (page wait timeout)
    ENGINE_FINISHED = "engine_finished"  # engine: the request's final output
    RECOMPUTE = "recompute"  # worker: a failed KV load is computed again (kv_load_failure_policy)


class PrefillState(enum.Enum):
    QUEUED = "queued"  # accepted, in the engine's queue
    RUNNING = "running"  # its first chunk is scheduled: writes start
    SENDING = "sending"  # the engine is done with it; writes (and the meta block) may be in flight
    FINISHED = "finished"  # every write done or stopped; pages freed


class PrefillEvent(enum.Enum):
    STARTED = "started"  # engine (KV sender's step hook): first chunk scheduled
    CANCEL = "cancel"  # messenger (the decode instance cancelled, or its connection was lost), fabric (send error)
    ENGINE_FINISHED = "engine_finished"  # engine: prefill done, failed or aborted
    FREEABLE = "freeable"  # fabric (KV sender): no write reads the pages any more


D, DE = DecodeState, DecodeEvent
DECODE_TRANSITIONS: dict[tuple[DecodeState, DecodeEvent], DecodeState] = {
    (D.QUEUED, DE.KV_NEEDED): D.WAITING_KV,
    (D.QUEUED, DE.LOCAL): D.RUNNING,
    (D.QUEUED, DE.CANCEL): D.QUEUED,  # the engine aborts it; ENGINE_FINISHED follows
    (D.QUEUED, DE.ENGINE_FINISHED): D.FINISHED,
    (D.WAITING_KV, DE.NO_PREFILL): D.FINISHED,  # nothing was sent: its pages go back at once
    (D.WAITING_KV, DE.LOCAL): D.RUNNING,  # a failed load is recomputed here
    (D.WAITING_KV, DE.PREFILL_STARTED): D.WAITING_KV,
    (D.WAITING_KV, DE.PREFILL_FAILED): D.WAITING_KV,  # the receive is cancelled; KV_FAILED follows
    (D.WAITING_KV, DE.KV_LANDED): D.RUNNING,
    (D.WAITING_KV, DE.KV_FAILED): D.RELEASING,
    (D.WAITING_KV, DE.CANCEL): D.CANCELLING,
    (D.WAITING_KV, DE.ENGINE_FINISHED): D.CANCELLING,  # the engine ended it (shut down, failed step)
    (D.CANCELLING, DE.KV_LANDED): D.FINISHED,  # every write landed: nothing more can
    (D.CANCELLING, DE.KV_FAILED): D.RELEASING,
    (D.CANCELLING, DE.ENGINE_FINISHED): D.CANCELLING,
    (D.CANCELLING, DE.CANCEL): D.CANCELLING,
    (D.CANCELLING, DE.PREFILL_STARTED): D.CANCELLING,
    (D.CANCELLING, DE.PREFILL_FAILED): D.CANCELLING,
    (D.RELEASING, DE.KV_RELEASED): D.FINISHED,
    (D.RELEASING, DE.ENGINE_FINISHED): D.RELEASING,
    (D.RELEASING, DE.CANCEL): D.RELEASING,
    (D.RELEASING, DE.PREFILL_STARTED): D.RELEASING,
    (D.RELEASING, DE.PREFILL_FAILED): D.RELEASING,
    (D.RELEASING, DE.RECOMPUTE): D.RECOVERING,  # the load failed, the request lives on
    (D.RECOVERING, DE.KV_RELEASED): D.WAITING_KV,  # no write can land: ask another prefill instance, or compute here
    (D.RECOVERING, DE.CANCEL): D.RELEASING,
    (D.RECOVERING, DE.ENGINE_FINISHED): D.RELEASING,
    (D.RECOVERING, DE.PREFILL_STARTED): D.RECOVERING,
    (D.RECOVERING, DE.PREFILL_FAILED): D.RECOVERING,
    (D.RUNNING, DE.CANCEL): D.RUNNING,  # the engine aborts it; ENGINE_FINISHED follows
    (D.RUNNING, DE.PREFILL_STARTED): D.RUNNING,  # a late message: the KV landed first
    (D.RUNNING, DE.PREFILL_FAILED): D.RUNNING,  # its prefill instance was lost after the KV landed
    (D.RUNNING, DE.ENGINE_FINISHED): D.FINISHED,
}

P, PE = PrefillState, PrefillEvent
PREFILL_TRANSITIONS: dict[tuple[PrefillState, PrefillEvent], PrefillState] = {
    (P.QUEUED, PE.STARTED): P.RUNNING,
    (P.QUEUED, PE.CANCEL): P.QUEUED,  # the engine aborts it; ENGINE_FINISHED follows
    (P.QUEUED, PE.ENGINE_FINISHED): P.SENDING,
    (P.RUNNING, PE.CANCEL): P.RUNNING,
    (P.RUNNING, PE.ENGINE_FINISHED): P.SENDING,
    (P.SENDING, PE.CANCEL): P.SENDING,  # stops the writes still to post
    (P.SENDING, PE.FREEABLE): P.FINISHED,
}

TERMINAL = (DecodeState.FINISHED, PrefillState.FINISHED)


class IllegalTransition(RuntimeError):
    """An event the transition table does not allow in the request's current state."""


class RequestState:
    """One request's state under one role's table."""

    def __init__(self, req_id: str, table: dict, initial: enum.Enum):
        self.req_id, self._table, self.state = req_id, table, initial
        self.history: list[enum.Enum] = [initial]

    @classmethod
    def decode(cls, req_id: str) -> RequestState:
        return cls(req_id, DECODE_TRANSITIONS, DecodeState.QUEUED)

    @classmethod
    def prefill(cls, req_id: str) -> RequestState:
        return cls(req_id, PREFILL_TRANSITIONS, PrefillState.QUEUED)

    def allows(self, event: enum.Enum) -> bool:
        return (self.state, event) in self._table

    def apply(self, event: enum.Enum) -> enum.Enum:
        """Move to the state the table gives for ``event``; returns the state it left."""
        new = self._table.get((self.state, event))
        if new is None:
            raise IllegalTransition(f"request {self.req_id}: {event.name} is not allowed in state {self.state.name}")
        old, self.state = self.state, new
        if new is not old:
            self.history.append(new)
        return old

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL
