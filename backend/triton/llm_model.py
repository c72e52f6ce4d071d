"""Triton Python-backend model for the client-facing roles (aggregated ``llm``, ``decode``).

``execute()`` only parses, validates, tokenizes and enqueues; the engine loop thread streams
responses through each request's response sender (decoupled model). The role parameter picks
the worker that generates tokens: ``aggregated`` (one engine, chunked prefill + decode) or
``decode`` (KV from prefill instances, see ``backend/serving/decode_worker.py``). A ``guided_json`` /
``guided_regex`` input is compiled here, so a bad one is refused before the worker sees it.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import threading
import uuid

import numpy as np

from backend.serving.session import GenerationSession
from backend.serving.detokenizer import IncrementalDetokenizer
from backend.triton.sender import GuardedSender
from backend.serving.request import RequestError, parse_request

log = logging.getLogger("triton_disagg.model")


def setup_logging() -> None:
    root = logging.getLogger("triton_disagg")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root.addHandler(h)
        root.setLevel(os.environ.get("TRITON_DISAGG_LOG_LEVEL", "INFO"))


class TritonSink:
    """Sends a session's responses through a Triton decoupled response sender."""

    def __init__(self, pb_utils, request):
        self.pb = pb_utils
        self.sender = GuardedSender(pb_utils, request.get_response_sender())

    def send(self, text, token_ids, n_input, n_output, finish_reason, final):
        pb = self.pb
        tensors = [
            pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object)),
            pb.Tensor("output_token_ids", np.asarray(token_ids, dtype=np.int32)),
            pb.Tensor("num_input_tokens", np.array([n_input], dtype=np.int32)),
            pb.Tensor("num_output_tokens", np.array([n_output], dtype=np.int32)),
            pb.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=object)),
        ]
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)

    def error(self, message):
        pb = self.pb
        self.sender.send(pb.InferenceResponse(error=pb.TritonError(message)),
                         flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()


def model_parameters(model_config: dict) -> dict:
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def init_model(args: dict):
    """Common start of every model's ``initialize``: logging, pb_utils, config, parameters,
    instance name. Returns ``(pb_utils, model_config, parameters, instance_name)``."""
    import triton_python_backend_utils as pb_utils
    setup_logging()
    cfg = json.loads(args["model_config"])
    return pb_utils, cfg, model_parameters(cfg), args.get("model_instance_name", cfg["name"])


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer
        from build_scripts.prepare_model import ensure_model
        from backend.serving.worker_factory import make_worker

        pb_utils, cfg, params, self.instance = init_model(args)
        self.pb = pb_utils
        self.role = params.get("role", "aggregated")
        model_path = ensure_model(params.get("model_path") or None)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.max_tokens_limit = int(params.get("max_tokens_limit", "1024"))
        self.max_queue = int(params.get("max_queue_size", "256"))
        self.worker = make_worker(self.role, str(model_path), params, self.instance)
        self.max_model_len = self.worker.max_model_len
        self.sessions: dict[str, GenerationSession] = {}
        self.by_triton_id: dict[str, str] = {}   # Triton request id -> our request id
        self._grammar_compiler = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._tag = uuid.uuid4().hex[:6]   # request ids stay unique across servers and restarts
        from backend.triton.metrics import InstanceMetrics
        self.metrics = InstanceMetrics(pb_utils, {"model": cfg["name"], "instance": self.instance},
                                       self._stats)
        log.info("instance %s ready: role %s, model %s, %s", self.instance, self.role, model_path,
                 self.worker.describe())

    def _stats(self) -> dict:
        s = dict(self.worker.stats())
        with self._lock:
            s["requests_active"] = len(self.sessions)
        return s

    def execute(self, requests):
        for request in requests:
            self._admit(request)
        return None

    def _admit(self, request) -> None:
        pb = self.pb
        sink = TritonSink(pb, request)

        def get(name):
            t = pb.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()
        cancel_id = get("cancel_request_id")
        if cancel_id is not None:   # a control request: cancel another request (see the front model)
            self._cancel_by_triton_id(cancel_id.reshape(-1)[0].decode())
            sink.sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        try:
            req = parse_request(get, max_tokens_limit=self.max_tokens_limit)
            self._compile_grammar(req)
            prompt_ids = self._tokenize(req)
            with self._lock:
                if len(self.sessions) >= self.max_queue:
                    raise RequestError(f"overloaded: {len(self.sessions)} requests in flight "
                                       f"(max_queue_size {self.max_queue}); retry later")
                req_id = f"{self.instance}-{self._tag}-{next(self._ids)}"
                session = GenerationSession(
                    req_id, req, prompt_ids, sink,
                    IncrementalDetokenizer(self.tokenizer, req.stop_words),
                    cancel_engine=self.worker.cancel, on_done=self._on_done)
                self.sessions[req_id] = session
                session.triton_id = request.request_id()
                if session.triton_id:
                    self.by_triton_id[session.triton_id] = req_id
            self.worker.submit(session)
        except RequestError as e:
            log.info("rejected request: %s", e)
            sink.error(str(e))
        except Exception as e:  # never let one request take the instance down
            log.exception("failed to admit request")
            sink.error(f"internal error: {e}")

    def _compile_grammar(self, req) -> None:
        if req.guided_json is None and req.guided_regex is None:
            return
        from backend.engine.sampling.grammar import GrammarCompiler, GrammarError
        with self._lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.worker.engine.runner.vocab_size)
        try:
            req.grammar = self._grammar_compiler.compile(req.guided_json, req.guided_regex)
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def _tokenize(self, req) -> list[int]:
        if req.apply_chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": req.text}],
                                                      add_generation_prompt=True, tokenize=False)
        else:
            text = req.text
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise RequestError("'text_input' tokenizes to nothing")
        if len(ids) + req.max_tokens > self.max_model_len:
            raise RequestError(f"prompt of {len(ids)} tokens plus max_tokens {req.max_tokens} exceeds "
                               f"the model context of {self.max_model_len} tokens")
        if req.end_id is None:
            req.end_id = self.tokenizer.eos_token_id
        return ids

    def _cancel_by_triton_id(self, triton_id: str) -> None:
        with self._lock:
            session = self.sessions.get(self.by_triton_id.get(triton_id, ""))
        if session is None:
            return
        log.info("request %s (%s) cancelled by its sender", session.req_id, triton_id)
        session.cancelled = True
        self.worker.cancel(session.req_id)

    def _on_done(self, session: GenerationSession, reason: str) -> None:
        with self._lock:
            self.sessions.pop(session.req_id, None)
            self.by_triton_id.pop(session.triton_id, None)
        self.metrics.add("requests_total", 1)
        self.metrics.add("output_tokens_total", session.n_output)
        if reason == "error":
            self.metrics.add("requests_failed_total", 1)
        if session.t_first is not None:
            self.metrics.add("ttft_seconds_total", session.t_first - session.t_start)

    def finalize(self):
        log.info("instance %s shutting down", self.instance)
        self.worker.shutdown()
        self.metrics.close()
