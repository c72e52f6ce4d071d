"""EngineLoop: runs an LLMEngine in a background thread behind a thread-safe API.

Every call only enqueues a typed command (:class:`Submit`, :class:`Cancel`, :class:`KVLoaded`,
:class:`ComputeHere`, :class:`Fail`, :class:`Release`, :class:`Stop`, and :class:`Wake` from the
engine itself); the loop thread applies them between steps,
so the engine (its scheduler, allocator and sequences) is touched by that thread alone. Each
request's ``on_output(EngineOutput)`` is called on the loop thread for every new token and once
at the end. A failing step fails the requests it touched (finish_reason "error", pages freed);
the loop keeps running.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from backend.engine.outputs import EngineOutput, ErrorKind, FinishReason
from backend.engine.protocol import Engine
from backend.engine.sampling_params import SamplingParams

log = logging.getLogger("triton_disagg.engine")

OutputCallback = Callable[[EngineOutput], None]


@dataclass(frozen=True)
class Submit:
    """Add a request. ``remote_kv``: its prompt's KV may be loaded from elsewhere (decode role,
    see ``Engine.set_kv_loader``); ``prefill_only``: compute the prompt, never sample."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None
    on_output: OutputCallback
    prefill_only: bool = False
    remote_kv: bool = False


@dataclass(frozen=True)
class Cancel:
    """Abort a request; its callback gets finish_reason "abort" (nothing if it already ended)."""

    req_id: str


@dataclass(frozen=True)
class KVLoaded:
    """A request waiting for remote KV has it (the prefill's last hidden state and logits)."""

    req_id: str
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class ComputeHere:
    """A request waiting for remote KV will not get it: compute its prompt here."""

    req_id: str


@dataclass(frozen=True)
class Fail:
    """End a request with this error (one waiting for remote KV keeps its pages: ``pages_held``)."""

    req_id: str
    message: str
    kind: ErrorKind


@dataclass(frozen=True)
class Release:
    """Free the pages a finished request still holds (``EngineOutput.pages_held``)."""

    req_id: str


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Wake:
    """The engine has work no command brought (a KV tier load finished): step again."""


Command = Submit | Cancel | KVLoaded | ComputeHere | Fail | Release | Stop | Wake


class EngineLoop:
    def __init__(self, engine: Engine, name: str = "engine-loop"):
        self.engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = threading.Event()
        self._num_steps = 0
        engine.set_waker(lambda: self._commands.put(Wake()))
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        on_output: OutputCallback,
        prefill_only: bool = False,
        remote_kv: bool = False,
    ) -> None:
        """Queue a request; an invalid one is answered through ``on_output`` with finish_reason "error"."""
        if self._stopping.is_set():
            raise RuntimeError("EngineLoop is shut down")
        self._commands.put(Submit(req_id, list(prompt_token_ids), sampling_params, on_output, prefill_only, remote_kv))

    def cancel(self, req_id: str) -> None:
        self._commands.put(Cancel(req_id))

    def kv_loaded(self, req_id: str, hidden: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> None:
        self._commands.put(KVLoaded(req_id, hidden, logits))

    def compute_here(self, req_id: str) -> None:
        self._commands.put(ComputeHere(req_id))

    def fail(self, req_id: str, message: str, kind: ErrorKind) -> None:
        self._commands.put(Fail(req_id, message, kind))

    def release(self, req_id: str) -> None:
        self._commands.put(Release(req_id))

    def stats(self) -> dict:
        waiting, running = self.engine.queue_lengths()
        return {
            "pool": self.engine.pool_stats(),
            "waiting": waiting,
            "running": running,
            "steps": self._num_steps,
            "alive": self._thread.is_alive(),
        }

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still active end with finish_reason "abort"."""
        if not self._stopping.is_set():
            self._stopping.set()
            self._commands.put(Stop())
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                # nothing to run, or nothing that can run until a command frees pages or seats
                self._apply_commands(block=not self.engine.has_work() or self.engine.stalled())
                if self.engine.has_work():
                    self._emit(self._step())
            except Exception:
                log.exception("engine loop iteration failed; continuing")
        for req_id in self.engine.active_request_ids():
            self._emit([self.engine.abort(req_id)])
        self._refuse_queued_submits()

    def _refuse_queued_submits(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Submit):
                self._call(
                    command.on_output,
                    EngineOutput(
                        command.req_id,
                        [],
                        finished=True,
                        finish_reason=FinishReason.ABORT,
                        error="engine loop shut down",
                    ),
                )

    def _step(self) -> list[EngineOutput]:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step raised; failing all active requests")
            outputs = self.engine.fail(self.engine.active_request_ids(), f"{type(exc).__name__}: {exc}")
        self._num_steps += 1
        return outputs

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: Command) -> None:
        match command:
            case Submit():
                self._submit(command)
            case Cancel(req_id):
                self._emit([self.engine.abort(req_id)])
            case KVLoaded(req_id, hidden, logits):
                if not self.engine.kv_loaded(req_id, hidden, logits):
                    log.debug("KV of %s landed after it ended", req_id)
            case ComputeHere(req_id):
                if not self.engine.compute_here(req_id):
                    log.debug("%s ended before it could be computed here", req_id)
            case Fail(req_id, message, kind):
                self._emit(self.engine.fail([req_id], message, kind))
            case Release(req_id):
                try:
                    freed = self.engine.release(req_id)
                except ValueError as e:  # still active: a bug in the caller, never a crash here
                    log.error("release of %s refused: %s", req_id, e)
                else:
                    log.debug("request %s: %d pages freed", req_id, freed)
            case Stop() | Wake():
                pass

    def _submit(self, command: Submit) -> None:
        req_id, on_output = command.req_id, command.on_output
        if req_id in self._callbacks:
            self._refuse(on_output, req_id, f"request {req_id!r} is already active")
            return
        try:
            self.engine.add_request(
                req_id,
                command.prompt_token_ids,
                command.params,
                prefill_only=command.prefill_only,
                remote_kv=command.remote_kv,
            )
        except Exception as exc:
            self._refuse(on_output, req_id, f"{type(exc).__name__}: {exc}")
            return
        self._callbacks[req_id] = on_output

    def _refuse(self, on_output: OutputCallback, req_id: str, message: str) -> None:
        """Answer a submit the engine cannot take (finish_reason "error", kind bad_request)."""
        error = EngineOutput(
            req_id, [], finished=True, finish_reason=FinishReason.ERROR, error=message, error_kind=ErrorKind.BAD_REQUEST
        )
        self._call(on_output, error)

    def _emit(self, outputs: Sequence[EngineOutput | None]) -> None:
        for output in outputs:
            if output is None:
                continue
            callback = self._callbacks.get(output.req_id)
            if output.finished:
                self._callbacks.pop(output.req_id, None)
            if callback is not None and not self._call(callback, output) and not output.finished:
                self._callbacks.pop(output.req_id, None)
                self._emit([self.engine.abort(output.req_id)])

    @staticmethod
    def _call(callback: OutputCallback, output: EngineOutput) -> bool:
        try:
            callback(output)
            return True
        except Exception:
            log.exception("on_output callback for %r raised", output.req_id)
            return False
