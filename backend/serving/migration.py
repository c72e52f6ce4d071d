"""The move loop's decisions, built once for both fronts (like Dynamo's single Migration operator):
a :class:`Migration` is one client request across its attempts on decode targets, and says what
each step of the loop does; the fronts only open streams and relay (the Triton front model,
``backend/triton/front_model.py``, on threads; the OpenAI frontend, ``backend/openai/router.py``,
on its event loop).

- The first target: the routing core's pick; while none serves but one has never passed a
  probe (a server starting), the front waits for it, at most ``health_probe_timeout_s``; then
  the request fails as out of service, saying why (:meth:`Migration.first`).
- Each attempt is a child span of the request's (``route <target>``), its context sent with the
  call (:meth:`Migration.begin`).
- An attempt's error either moves the request or is its answer (:meth:`Migration.outcome`,
  ``move_reason``); a stream that ended early or broke (``stream_error``) counts as a failed
  probe of its target (the front tells ``TargetWatch.failed``, holding no lock of a request's),
  and a target that goes down or leaves moves the requests in flight there (``instance_down``:
  :func:`lost_why`).
- A move (:meth:`Migration.moved`): the routing core picks another target, never one that failed
  the request before, and the request goes there with the prompt plus every output token its
  client has (``resume_token_ids``): the client sees one stream, no token repeated or lost; at
  most ``migration_limit`` moves, then :class:`NotMoved` with the client's error message. Each
  move is an event of the request's span.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.cluster.tracing import NO_SPAN, Span
from backend.engine.outputs import ErrorKind
from backend.serving.errors import parse_error
from backend.serving.routing import Journey, NotMoved, RoutingTable, move_reason


def lost_why(why: str) -> str:
    """Why an attempt ended whose target went down or left (``why``) under it."""
    return f"stopped serving ({why})"


@dataclass(eq=False, kw_only=True)
class Migration(Journey):
    """A request's :class:`Journey` with its move loop's state: ``span`` (the request's),
    ``attempt`` (how many were begun), ``target`` (the current attempt's) and ``attempt_span``."""

    span: Span = NO_SPAN
    attempt: int = 0
    target: str = ""
    attempt_span: Span = NO_SPAN

    def first(self, table: RoutingTable, waited_s: float) -> str | None:
        """The first target (in flight there until ``table.done``), or None to ask again a moment
        later (none serves, but one has never passed a probe and ``waited_s`` is under
        ``health_probe_timeout_s``); :class:`NotMoved` when none serves."""
        target = table.pick(self)
        if target is not None:
            return target
        if table.awaiting_first_probe() and waited_s < table.settings.health_probe_timeout_s:
            return None
        raise NotMoved(f"no {table.noun} is serving ({table.down_reasons()})")

    def begin(self, target: str) -> Span:
        """A new attempt on ``target``; its span."""
        self.attempt += 1
        self.target = target
        self.attempt_span = self.span.child(
            f"route {target}",
            {
                "triton_disagg.attempt": self.attempt,
                "triton_disagg.target": target,
                "triton_disagg.resumed_tokens": len(self.sent),
            },
            kind="client",
        )
        return self.attempt_span

    def outcome(self, error: str) -> tuple[str | None, ErrorKind | None, str]:
        """An attempt's error: (the move's reason, None when it is the request's answer; its
        kind; its message)."""
        kind, message = parse_error(error)
        return move_reason(kind, self), kind, message

    def moved(self, table: RoutingTable, target: str, why: str, reason: str) -> str:
        """The attempt on ``target`` ended, ``why``, without finishing the request: the target it
        continues on (its attempt not begun yet), or :class:`NotMoved`."""
        self.attempt_span.end(error=why)  # this attempt failed, whether the request moves or not
        retry = table.move(self, target, why, reason)
        self.span.event(
            "triton_disagg.migration",
            {
                "triton_disagg.from": target,
                "triton_disagg.to": retry,
                "triton_disagg.reason": reason,
                "triton_disagg.sent_tokens": len(self.sent),
            },
        )
        return retry
