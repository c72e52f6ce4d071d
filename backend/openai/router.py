"""The OpenAI frontend's router: an asyncio adapter over the routing and migration core
(``backend/serving/routing.py``, which the Triton front model shares: target health, the
KV-aware pick, the excluded targets, the migration limit, the resume), for the decode instances
of the deployment's membership.

Its membership watcher and readiness probes are the shared ones (``Router.watch``,
``backend/serving/target_watch.py``): a record that joins, changes or leaves, and each probe's
outcome, reach the core through it; the requests in flight on an instance that goes down or
leaves move at once (reason ``instance_down``).

:meth:`Router.generate` relays one request as one stream of deltas. When its stream fails with an
error of kind None (Triton's own, e.g. a dead stub), ``out_of_service`` or ``draining``, breaks
(gRPC unavailable, connection lost) or ends without a final response (reason ``stream_error``;
it counts as a failed probe of that instance), the request continues on another instance, never
one that failed it before, with every output token its client has received as
``resume_token_ids``: the decode model continues after them (counts, grammar, detokenizer) and
sends only what follows, so the client sees no token repeated or lost. Log-probabilities follow
the tokens they belong to; the prompt's (asked for with ``echo``) come once, in the first
response relayed: an attempt after that is not asked for them (:meth:`DecodeFleet.generate`
asks only while no output token was sent) and any it sends anyway are dropped here. At most
``migration_limit`` moves; then, as when no other instance serves, the stream ends with an
``out_of_service`` error saying why. An ``overloaded`` refusal (no KV pages for it in time)
before any output moves it too, to an instance with room; with none, the refusal is its
answer. Any other error (bad request, ...) is the request's answer and ends it as is. A new
request while no instance serves fails at once, unless one has not passed a probe yet (a server
starting): it waits for that at most ``health_probe_timeout_s``.

With tracing, each attempt is a child span (``route <instance>``) of the request's span, its
context sent with the call (``OpenStream``'s third argument), and each move an event of the
request's span.

Everything here runs on the frontend's event loop (the watcher hands what it learns to it); opening
a stream is the caller's (``OpenStream``), so the logic runs in unit tests with fake targets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from backend.cluster.tracing import NO_SPAN, Span
from backend.engine.outputs import ErrorKind
from backend.openai.triton_stream import Delta, GenerationError, StreamLost
from backend.serving.config import RouterSettings
from backend.serving.decode_stream import GrpcLink
from backend.serving.migration import Migration, lost_why
from backend.serving.routing import (
    FIRST_PICK_POLL_S,
    Journey,
    NotMoved,
    RoutingTable,
    Target,
    TargetStatus,
    move_reason,
)
from backend.serving.target_watch import TargetWatch

__all__ = ["Router", "Target"]

log = logging.getLogger("triton_disagg.openai")

# opens one attempt of a request on a target, after the output the client already has, with the
# attempt's trace context ("" : not traced)
OpenStream = Callable[[Target, list[int], str], AsyncIterator[Delta]]


@dataclass(eq=False, kw_only=True)
class _Journey(Migration):
    """A request across its attempts (the shared move loop's state); ``lost`` is set when the
    instance of its current attempt went down or left under it (``why``)."""

    lost: asyncio.Event = field(default_factory=asyncio.Event)
    why: str = ""


class _Moved(Exception):
    """An attempt ended without finishing its request, for a reason that lets it move."""

    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason, self.why = reason, why


class Router:
    """``watch``: the shared membership watcher and readiness probes (``TargetWatch``: membership
    records, with draining, health and cache summaries, and each probe's outcome) over ``table``,
    the routing core; ``generate(...)`` relays a request; ``migrations`` counts moves by reason;
    ``status()`` lists the members.
    ``settings``: the router settings the Triton front model has too (``RouterSettings``:
    probes, KV-routing weight, migration limit)."""

    def __init__(self, settings: RouterSettings | None = None):
        self.settings = settings = settings or RouterSettings()
        self.table = RoutingTable(settings, log)
        self.watch = TargetWatch(self.table, lambda t: GrpcLink(t, settings.health_probe_timeout_s), self._lost)
        self.migrations = self.table.migrations
        self.kv = self.table.kv

    def _lost(self, name: str, why: str, journeys: list[Journey]) -> None:
        """``name`` went down or left under these requests' attempts: they move."""
        for journey in journeys:
            if isinstance(journey, _Journey):
                journey.why = lost_why(why)
                journey.lost.set()

    def targets(self) -> list[Target]:
        return [t for t in map(self.table.target, self.table.names()) if t is not None]

    def serving(self, exclude: Iterable[str] = ()) -> list[Target]:
        """The members a new request may go to: up, not draining, not in ``exclude``."""
        return [t for t in map(self.table.target, self.table.serving(exclude)) if t is not None]

    def down_reasons(self) -> str:
        return self.table.down_reasons()

    def status(self) -> list[tuple[Target, TargetStatus]]:
        return [(t, s) for s in self.table.status() if (t := self.table.target(s.name)) is not None]

    def pick(self, journey: Journey, exclude: Iterable[str] = ()) -> Target | None:
        name = self.table.pick(journey, exclude)
        return None if name is None else self.table.target(name)

    # ------------------------------------------------------------ routing
    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        max_tokens: int,
        open_stream: OpenStream,
        cache_salt: str = "",
        span: Span = NO_SPAN,
    ) -> AsyncGenerator[Delta, None]:
        """The request's deltas until the one with a finish reason, across as many members as it
        takes (at most ``migration_limit`` moves); :class:`GenerationError` when it fails for
        good. ``token_ids``: its prompt, for routing (empty: by load alone). Closing the
        iterator early closes the open stream (which cancels the request there). ``cache_salt``:
        its prefix-cache tenant (routing matches only pages cached under it)."""
        journey = _Journey(
            request_id, list(token_ids), self.table.pages(len(token_ids) + max_tokens), cache_salt=cache_salt, span=span
        )
        target = await self._first_pick(journey)
        while True:
            attempt = journey.begin(target.name)
            try:
                stream = open_stream(target, list(journey.sent), attempt.traceparent())
                # closed explicitly (aclosing): a client that leaves must cancel the call at once
                async with contextlib.aclosing(self._attempt(target, journey, stream)) as deltas:
                    async for delta in deltas:
                        journey.sent.extend(delta.token_ids)
                        if delta.prompt_token_ids is not None and not journey.relay_prompt():
                            delta = delta.without_prompt()  # sent by an earlier attempt
                        yield delta
                        if delta.finish_reason is not None:
                            attempt.end()
                            return
                raise _Moved("stream_error", "its stream ended before the request finished")
            except _Moved as moved:
                if moved.reason == "stream_error":  # counts as a failed probe of that instance
                    self.watch.failed(target.name, moved.why)
                try:
                    retry = self.table.target(journey.moved(self.table, target.name, moved.why, moved.reason))
                except NotMoved as e:
                    raise GenerationError(e.kind, e.message) from None
                if retry is None:  # it left in this very moment
                    raise GenerationError(
                        ErrorKind.OUT_OF_SERVICE, f"{target.name}: {moved.why}; its successor left"
                    ) from None
                target = retry
            finally:
                attempt.end(error="the request ended during this attempt")  # (a no-op once ended)

    async def _first_pick(self, journey: _Journey) -> Target:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while True:
            try:
                name = journey.first(self.table, loop.time() - t0)
            except NotMoved as e:
                raise GenerationError(e.kind, e.message) from None
            if name is not None and (target := self.table.target(name)) is not None:
                return target
            await asyncio.sleep(FIRST_PICK_POLL_S)

    async def _attempt(
        self, target: Target, journey: _Journey, stream: AsyncIterator[Delta]
    ) -> AsyncGenerator[Delta, None]:
        """One attempt's deltas; raises :class:`_Moved` when the request may continue elsewhere
        (its member went down, or the stream failed in a way that is not the request's)."""
        journey.lost = asyncio.Event()
        lost = asyncio.ensure_future(journey.lost.wait())
        try:
            while True:
                step = asyncio.ensure_future(anext(stream))
                try:
                    await asyncio.wait({step, lost}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not step.done():  # lost, or this task was cancelled: stop reading
                        step.cancel()
                        with contextlib.suppress(BaseException):
                            await step
                if not step.done() or step.cancelled():
                    raise _Moved("instance_down", journey.why)
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    return
                except StreamLost as exc:
                    raise _Moved("stream_error", exc.message) from None
                except GenerationError as exc:
                    reason = move_reason(exc.kind, journey)
                    if reason is not None:
                        raise _Moved(reason, exc.message) from None
                    raise
                self.table.heard(target.name)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            lost.cancel()
            self.table.done(target.name, journey)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
