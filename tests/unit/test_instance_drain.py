"""The drain of an instance that Triton sends no requests (``backend.serving.worker.Drain``,
what a prefill instance runs on ``triton-disagg drain`` or a server stop): draining in the
membership first, what it holds may finish, then it leaves; once only; an unregistered
instance has nothing to drain. The drain of a real prefill instance in a real deployment is
checked by ``tests/integration/test_membership_deployment.py``."""

from __future__ import annotations

import threading

from backend.engine.cache_summary import CacheSummary
from backend.serving.prefill_worker import PrefillWorker
from backend.serving.stats import InstanceStats
from backend.serving.worker import Drain, Instance, Worker


class FakeInstance:
    def __init__(self, name: str | None = "p-1"):
        self.name, self.held, self.calls = name, 2, []
        self.left = threading.Event()

    def describe(self) -> str:
        return "fake"

    def stats(self) -> InstanceStats:
        return InstanceStats()

    def observations(self) -> dict[str, list[float]]:
        return {}

    def health(self) -> str | None:
        return None

    def cache_summary(self) -> CacheSummary:
        raise NotImplementedError

    def in_flight(self) -> int:
        return self.held

    def leave(self, final: bool) -> None:
        self.calls.append(("leave", final, self.held))
        if final:
            self.left.set()

    def member_name(self) -> str | None:
        return self.name

    def shutdown(self) -> None:
        pass


def test_draining_first_then_leaves_once_what_it_holds_finished():
    inst = FakeInstance()
    drain = Drain(inst, "prefill p-1", timeout_s=30)
    thread = drain.start()
    assert thread is not None and inst.calls == [("leave", False, 2)]
    assert drain.start() is None  # a second request while draining: nothing more
    assert not inst.left.wait(0.3)  # it still holds two requests
    inst.held = 0
    thread.join(5)
    assert inst.calls == [("leave", False, 2), ("leave", True, 0)]


def test_leaves_at_the_timeout_with_requests_still_held():
    inst = FakeInstance()
    thread = Drain(inst, "prefill p-1", timeout_s=0.3).start()
    assert thread is not None
    thread.join(5)
    assert inst.calls == [("leave", False, 2), ("leave", True, 2)]


def test_an_unregistered_instance_has_nothing_to_drain():
    inst = FakeInstance(name=None)
    assert Drain(inst, "prefill p-1", timeout_s=1).start() is None
    assert inst.calls == []


def test_every_role_implements_the_instance_protocol():
    """PrefillWorker has every method of :class:`Instance` (and Triton sends it no requests:
    it has no ``submit``); the client-facing workers are :class:`Worker`s."""
    from backend.serving.aggregated_worker import AggregatedWorker
    from backend.serving.decode_worker import DecodeWorker

    def methods(proto) -> set[str]:
        return {n for n in dir(proto) if not n.startswith("_")}

    for cls in (PrefillWorker, AggregatedWorker, DecodeWorker):
        assert methods(Instance) <= set(dir(cls)), (cls, methods(Instance) - set(dir(cls)))
    for cls in (AggregatedWorker, DecodeWorker):
        assert {"submit", "cancel"} <= set(dir(cls)), cls
    assert {"submit", "cancel"} <= methods(Worker) and not {"submit", "cancel"} & methods(Instance)
