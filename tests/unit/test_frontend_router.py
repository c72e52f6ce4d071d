"""The OpenAI frontend's router (``backend/openai/router.py``) without servers: which members it
routes to (ready, and serving by its membership record; KV-aware by the record's cache
summary), and how a request moves when its stream fails (never back to a member that failed it,
with the output already sent, at most ``migration_limit`` times), against fake decode instances
whose streams follow a script."""

from __future__ import annotations

import asyncio
import json

import pytest

from backend.cluster.prometheus_text import samples
from backend.cluster.records import InstanceRecord
from backend.engine.cache_summary import CacheSummary, page_key
from backend.engine.outputs import ErrorKind
from backend.engine.page_allocator import page_hashes
from backend.openai.metrics import exposition
from backend.openai.router import Router, Target
from backend.openai.triton_stream import Delta, GenerationError, StreamLost
from backend.serving.config import RouterSettings
from backend.serving.routing import Journey

SALT = "00"


def record(name: str, draining: bool = False, cached: list[int] | None = None, health: str = "") -> InstanceRecord:
    """Member ``name``'s membership record: draining, why it cannot serve, its cache summary."""
    cache = json.dumps(summary(cached).to_json())
    return InstanceRecord(
        "d", name, "decode", f"{name}:8001", "decode_0", "", "m", "l", 1, 0.0, draining, health=health, cache=cache
    )


def summary(cached: list[int] | None = None, page_size: int = 4) -> CacheSummary:
    ids = cached or []
    keys = frozenset(page_key(h) for h in page_hashes(ids, page_size, bytes.fromhex(SALT)))
    return CacheSummary(SALT, page_size, 1, keys, 1000, 1000, 0, 0)


def router(*names: str, up: bool = True, **kw) -> Router:
    r = Router(RouterSettings(**kw))
    r.watch.update([record(n) for n in names], [])
    if up:
        for n in names:
            r.watch.probed(n)
    return r


def journey(prompt: list[int], pages: int = 1) -> Journey:
    return Journey("req", prompt, pages)


def token(i: int) -> int:
    return 1000 + i  # the i-th output token of the (deterministic) fake model


class FakeDecode:
    """Scripted decode instances: ``plans[name]`` is a list, one entry per attempt there, of
    ``(n, end)``: send ``n`` tokens after the resumed ones, then ``end``: "ok" (finish), an
    exception to raise, "eof" (stream ends without a final response) or "hang"."""

    def __init__(self, max_tokens: int, plans: dict[str, list[tuple[int, object]]]):
        self.max_tokens, self.plans = max_tokens, plans
        self.calls: list[tuple[str, list[int]]] = []  # (target, resume_token_ids) per attempt
        self.closed: list[str] = []  # targets whose stream was closed before its end

    def open(self, target: Target, resume: list[int], traceparent: str = ""):
        self.calls.append((target.name, list(resume)))
        n, end = self.plans[target.name].pop(0)
        return self._stream(target.name, len(resume), n, end)

    async def _stream(self, name: str, start: int, n: int, end):
        finished = False
        try:
            i = start
            while i < self.max_tokens and (end == "ok" or i < start + n):
                last = i + 1 == self.max_tokens
                finished = last  # closed after its final response: nothing to cancel
                yield Delta(f"t{i} ", 7, i + 1, "length" if last else None, [token(i)])
                i += 1
                await asyncio.sleep(0)
            finished = True
            if end == "hang":
                await asyncio.Event().wait()
            if isinstance(end, BaseException):
                raise end
        finally:
            if not finished or end == "hang":
                self.closed.append(name)


async def collect(r: Router, fake: FakeDecode, prompt: list[int] | None = None) -> list[Delta]:
    out = []
    async for d in r.generate("req", prompt or [1, 2, 3], fake.max_tokens, fake.open):
        out.append(d)
    return out


def whole(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


# ------------------------------------------------------------------ member selection


def test_only_ready_members_whose_record_says_they_serve_serve():
    r = router("a", "b", up=False)
    assert r.serving() == [] and r.pick(journey([1, 2])) is None
    r.watch.probed("a")
    assert [t.name for t in r.serving()] == ["a"]
    r.watch.update([record("b", draining=True)], [])
    r.watch.probed("b")
    assert [t.name for t in r.serving()] == ["a"]
    assert {getattr(r.pick(journey([1, 2])), "name", None) for _ in range(6)} == {"a"}
    assert "b: draining" in r.down_reasons()
    r.watch.update([record("b")], [])  # it serves again
    assert {t.name for t in r.serving()} == {"a", "b"}
    r.watch.update([record("b", health="decode instance b: no prefill instance connected")], [])
    assert [t.name for t in r.serving()] == ["a"] and "b: decode instance b: no prefill" in r.down_reasons()
    r.watch.update([record("b")], [])
    r.watch.update([], [record("a")])
    assert [t.name for t in r.serving()] == ["b"] and [t.name for t in r.targets()] == ["b"]


def test_probe_failures_take_a_member_down_and_one_pass_brings_it_back():
    r = router("a", "b", health_probe_failures=2)
    r.watch.probed("a", "Triton at a:8001: decode model decode_0 is not ready")
    assert {t.name for t in r.serving()} == {"a", "b"}  # one failure is not enough
    r.watch.probed("a", "Stub process is not healthy")
    assert [t.name for t in r.serving()] == ["b"]
    assert "Stub process is not healthy" in r.down_reasons()
    r.watch.probed("a")
    assert {t.name for t in r.serving()} == {"a", "b"}
    r.watch.probed("gone")  # a probe of a member that left meanwhile: ignored


def test_pick_prefers_the_member_that_caches_the_prompt():
    prompt = list(range(40))
    r = router("a", "b")
    r.watch.update([record("b", cached=prompt)], [])
    for _ in range(4):
        request = journey(prompt, 3)
        target = r.pick(request)
        assert target is not None and target.name == "b"
        r.table.done(target.name, request)
    other = r.pick(journey(prompt, 3), exclude=["b"])
    assert other is not None and other.name == "a"


# ------------------------------------------------------------------ migration


def test_a_request_on_a_healthy_member_is_relayed_as_is():
    r = router("a")
    fake = FakeDecode(6, {"a": [(0, "ok")]})
    out = asyncio.run(collect(r, fake))
    assert whole(out) == [token(i) for i in range(6)] and out[-1].finish_reason == "length"
    assert fake.calls == [("a", [])] and r.migrations == {}


@pytest.mark.parametrize(
    "failure",
    [
        GenerationError(ErrorKind.OUT_OF_SERVICE, "draining"),
        GenerationError(None, "Stub process 'decode_0_0_0' is not healthy"),
        StreamLost(ErrorKind.OUT_OF_SERVICE, "Triton at a:8001 failed the call: Socket closed"),
        "eof",
    ],
)
def test_a_failed_stream_moves_with_the_tokens_already_sent(failure):
    r = router("a", "b")
    fake = FakeDecode(10, {"a": [(4, failure)], "b": [(0, "ok")]})
    prompt = list(range(40))
    r.watch.update([record("a", cached=prompt)], [])  # a holds the prompt: it is picked first
    out = asyncio.run(collect(r, fake, prompt))
    assert whole(out) == [token(i) for i in range(10)]  # nothing repeated, nothing lost
    assert "".join(d.text for d in out) == "".join(f"t{i} " for i in range(10))
    assert fake.calls == [("a", []), ("b", [token(i) for i in range(4)])]
    assert r.migrations == {"stream_error": 1}
    assert r.kv.inflight("a") == 0 and r.kv.inflight("b") == 0


def test_a_retry_never_goes_back_to_a_member_that_failed_it():
    prompt = list(range(40))
    r = router("a", "b", "c")
    r.watch.update([record("a", cached=prompt)], [])
    r.watch.update([record("b", cached=prompt[:20])], [])  # second best after a
    lost = StreamLost(ErrorKind.OUT_OF_SERVICE, "connection lost")
    fake = FakeDecode(9, {"a": [(2, lost)], "b": [(3, lost)], "c": [(0, "ok")]})
    out = asyncio.run(collect(r, fake, prompt))
    assert whole(out) == [token(i) for i in range(9)]
    assert [name for name, _ in fake.calls] == ["a", "b", "c"]
    assert fake.calls[2][1] == [token(i) for i in range(5)]
    assert r.migrations == {"stream_error": 2}


def test_past_the_migration_limit_the_request_fails_saying_so():
    r = router("a", "b", "c", "d", migration_limit=2)
    lost = StreamLost(ErrorKind.OUT_OF_SERVICE, "connection lost")
    fake = FakeDecode(20, {n: [(1, lost)] for n in "abcd"})
    got: list[Delta] = []

    async def run():
        async for d in r.generate("req", [1, 2], 20, fake.open):
            got.append(d)

    with pytest.raises(GenerationError) as e:
        asyncio.run(run())
    assert e.value.kind is ErrorKind.OUT_OF_SERVICE and "migration limit reached" in e.value.message
    assert len(fake.calls) == 3 and len({name for name, _ in fake.calls}) == 3  # two moves, never back
    assert whole(got) == [token(i) for i in range(3)]
    assert r.migrations == {"stream_error": 2}


def test_an_overloaded_refusal_before_any_output_moves_to_a_member_with_room():
    """No KV pages for it in time on a (a full pool): the request goes to b (the one the
    autoscaler just added, say); a is not counted as failed. With no other member, or after
    output was sent, the refusal is the client's answer."""
    full = GenerationError(ErrorKind.OVERLOADED, "no KV pages free on the decode instance within 10s")
    prompt = list(range(40))
    r = router("a", "b", health_probe_failures=1)
    r.watch.update([record("a", cached=prompt)], [])  # a holds the prompt: it is picked first
    fake = FakeDecode(6, {"a": [(0, full)], "b": [(0, "ok")]})
    out = asyncio.run(collect(r, fake, prompt))
    assert whole(out) == [token(i) for i in range(6)] and [n for n, _ in fake.calls] == ["a", "b"]
    assert r.migrations == {"overloaded": 1}
    assert sorted(t.name for t in r.serving()) == ["a", "b"]  # a full pool is not a failure
    alone = router("a")
    fake = FakeDecode(6, {"a": [(0, full)]})
    with pytest.raises(GenerationError) as e:
        asyncio.run(collect(alone, fake))
    assert e.value.kind is ErrorKind.OVERLOADED and e.value.message == full.message
    assert alone.migrations == {}
    r = router("a", "b")
    r.watch.update([record("a", cached=prompt)], [])
    fake = FakeDecode(6, {"a": [(2, full)], "b": [(0, "ok")]})  # after output: not moved
    with pytest.raises(GenerationError) as e:
        asyncio.run(collect(r, fake, prompt))
    assert e.value is full and len(fake.calls) == 1
    never = router("a", "b", migration_limit=0)
    fake = FakeDecode(6, {"a": [(0, full)], "b": [(0, "ok")]})
    with pytest.raises(GenerationError) as e:
        asyncio.run(collect(never, fake))
    assert e.value.kind is ErrorKind.OVERLOADED and len(fake.calls) == 1


def test_with_no_other_member_the_request_fails_and_a_bad_request_never_moves():
    r = router("a")
    fake = FakeDecode(5, {"a": [(2, GenerationError(None, "Stub process is not healthy"))]})
    with pytest.raises(GenerationError) as e:
        asyncio.run(collect(r, fake))
    assert e.value.kind is ErrorKind.OUT_OF_SERVICE and "no other decode instance is serving" in e.value.message
    r = router("a", "b")
    bad = GenerationError(ErrorKind.BAD_REQUEST, "'max_tokens' exceeds the configured limit")
    fake = FakeDecode(5, {"a": [(0, bad)], "b": [(0, bad)]})
    with pytest.raises(GenerationError) as e:
        asyncio.run(collect(r, fake))
    assert e.value is bad and len(fake.calls) == 1 and r.migrations == {}
    down = router("a", health_probe_failures=1)
    down.watch.probed("a", "Stub process is not healthy")
    with pytest.raises(GenerationError) as e:
        asyncio.run(collect(down, fake))  # at once: its probe failed
    assert e.value.kind is ErrorKind.OUT_OF_SERVICE and "no decode instance is serving" in e.value.message
    assert "a: Stub process is not healthy" in e.value.message


@pytest.mark.parametrize("how", ["probes fail", "leaves"])
def test_requests_in_flight_on_a_member_that_goes_down_move(how):
    r = router("a", "b", health_probe_failures=2)
    prompt = list(range(40))
    r.watch.update([record("a", cached=prompt)], [])
    fake = FakeDecode(8, {"a": [(3, "hang")], "b": [(0, "ok")]})

    async def run():
        task = asyncio.ensure_future(collect(r, fake, prompt))
        while not fake.calls:
            await asyncio.sleep(0)
        for _ in range(20):
            await asyncio.sleep(0)  # a sends its 3 tokens and hangs
        if how == "leaves":
            r.watch.update([], [record("a")])
        else:
            r.watch.probed("a", "Stub process is not healthy")
            r.watch.probed("a", "Stub process is not healthy")
        return await asyncio.wait_for(task, 5)

    out = asyncio.run(run())
    assert whole(out) == [token(i) for i in range(8)]
    assert fake.calls == [("a", []), ("b", [token(i) for i in range(3)])]
    assert fake.closed == ["a"]  # the hung call was cancelled
    assert r.migrations == {"instance_down": 1}


def test_closing_the_stream_early_closes_the_call():
    r = router("a")
    fake = FakeDecode(50, {"a": [(0, "ok")]})

    async def run():
        deltas = r.generate("req", [1, 2], 50, fake.open)
        assert (await anext(deltas)).token_ids == [token(0)]
        await deltas.aclose()

    asyncio.run(run())
    assert fake.closed == ["a"] and r.kv.inflight("a") == 0


def test_metrics_exposition():
    r = router("a", "b")
    r.watch.update([record("b", draining=True)], [])
    r.migrations["stream_error"] += 2
    r.pick(journey([1]))
    text = exposition(r)
    got = samples(text)  # prometheus_client's own parser reads it back
    assert got[("triton_disagg_migrations_total", frozenset({("reason", "stream_error")}))] == 2
    assert got[("triton_disagg_migrations_total", frozenset({("reason", "instance_down")}))] == 0
    at = lambda name: frozenset({("target", name), ("grpc_url", f"{name}:8001"), ("model", "decode_0")})  # noqa: E731
    assert got[("triton_disagg_decode_target_up", at("a"))] == 1
    assert got[("triton_disagg_decode_target_up", at("b"))] == 0
    assert got[("triton_disagg_requests_routed_total", at("a"))] == 1
    assert "# TYPE triton_disagg_migrations_total counter" in text
    assert exposition(None).count("triton_disagg_migrations_total{") == 3  # one per reason, moved or not
    assert got[("triton_disagg_migrations_total", frozenset({("reason", "overloaded")}))] == 0
