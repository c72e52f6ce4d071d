"""EngineLoop: runs an LLMEngine in a background thread behind a thread-safe API.

``submit`` and ``cancel`` only enqueue; the loop thread applies them between steps and calls each
request's ``on_output(EngineOutput)`` for every new token and once at the end. A failing step
fails the requests it touched (finish_reason "error", pages freed); the loop keeps running.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from backend.engine.outputs import EngineOutput, ErrorKind, FinishReason
from backend.engine.protocol import Engine
from backend.engine.sampling_params import SamplingParams

log = logging.getLogger("triton_disagg.engine")

OutputCallback = Callable[[EngineOutput], None]


class EngineLoop:
    def __init__(self, engine: Engine, name: str = "engine-loop"):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = threading.Event()
        self._num_steps = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        on_output: OutputCallback,
        prefill_only: bool = False,
        kv_ready_tokens: int = 0,
        prefill_state: tuple | None = None,
    ) -> None:
        """Queue a request; an invalid one is answered through ``on_output`` with finish_reason "error".
        ``prefill_state``: (hidden, logits) of the last prefilled position, sent with the KV."""
        if self._stopping.is_set():
            raise RuntimeError("EngineLoop is shut down")
        self._commands.put(
            (
                "submit",
                req_id,
                list(prompt_token_ids),
                sampling_params,
                on_output,
                prefill_only,
                kv_ready_tokens,
                prefill_state,
            )
        )

    def cancel(self, req_id: str) -> None:
        """Abort a request; its callback gets finish_reason "abort" (nothing if it already ended)."""
        self._commands.put(("cancel", req_id))

    def reserve(self, req_id: str, n_tokens: int, token_ids: list[int] | None = None) -> list[int]:
        return self.engine.reserve(req_id, n_tokens, token_ids)

    def cached_tokens(self, req_id: str) -> int:
        return self.engine.cached_tokens(req_id)

    def cancel_reservation(self, req_id: str) -> None:
        self.engine.cancel_reservation(req_id)

    def release(self, req_id: str) -> int:
        return self.engine.release(req_id)

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
            self._commands.put(("stop",))
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._apply_commands(block=not self.engine.has_work())
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
            if command[0] == "submit":
                self._call(
                    command[4],
                    EngineOutput(
                        command[1], [], finished=True, finish_reason=FinishReason.ABORT, error="engine loop shut down"
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

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "submit":
            _, req_id, prompt, params, on_output, prefill_only, kv_ready_tokens, prefill_state = command
            hidden, logits = prefill_state or (None, None)
            if req_id in self._callbacks:
                self._refuse(on_output, req_id, f"request {req_id!r} is already active")
                return
            try:
                self.engine.add_request(
                    req_id,
                    prompt,
                    params,
                    prefill_only=prefill_only,
                    kv_ready_tokens=kv_ready_tokens,
                    prefill_hidden=hidden,
                    prefill_logits=logits,
                )
            except Exception as exc:
                self._refuse(on_output, req_id, f"{type(exc).__name__}: {exc}")
                return
            self._callbacks[req_id] = on_output
        elif kind == "cancel":
            output = self.engine.abort(command[1])
            if output is not None:
                self._emit([output])

    def _refuse(self, on_output: OutputCallback, req_id: str, message: str) -> None:
        """Answer a submit the engine cannot take (finish_reason "error", kind bad_request)."""
        error = EngineOutput(
            req_id, [], finished=True, finish_reason=FinishReason.ERROR, error=message, error_kind=ErrorKind.BAD_REQUEST
        )
        self._call(on_output, error)

    def _emit(self, outputs: list[EngineOutput]) -> None:
        for output in outputs:
            callback = self._callbacks.get(output.req_id)
            if output.finished:
                self._callbacks.pop(output.req_id, None)
            if callback is not None and not self._call(callback, output) and not output.finished:
                self._callbacks.pop(output.req_id, None)
                self.engine.abort(output.req_id)

    @staticmethod
    def _call(callback: OutputCallback, output: EngineOutput) -> bool:
        try:
            callback(output)
            return True
        except Exception:
            log.exception("on_output callback for %r raised; the request is aborted", output.req_id)
            return False
