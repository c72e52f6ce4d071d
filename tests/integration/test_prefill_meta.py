"""The hidden state and logits a decode instance receives with the KV (prefill worker -> NIXL meta
slot, moved by the fake NIXL between two workers in this process; real NIXL moves it in the
disaggregated server tests) equal those the decode instance's own
engine computes when it runs the same prefill itself; the request then decodes with the hidden
drafter fed by them."""

from __future__ import annotations

import threading

from engine_helpers import real_model_dir

from backend.engine.outputs import FinishReason
from backend.serving.detokenizer import IncrementalDetokenizer
from backend.serving.request import ClientRequest
from backend.serving.session import GenerationSession

TOLERANCE = 1e-4


class Sink:
    def __init__(self):
        self.token_ids, self.done, self.error = [], threading.Event(), None

    def send(self, text, token_ids, n_input, n_output, finish_reason, final, extras=None):
        self.token_ids += list(token_ids)
        if final:
            self.done.set()

    def error(self, message, kind):
        self.error = f"[{kind}] {message}"
        self.done.set()

    def close(self):
        self.done.set()

    def is_cancelled(self):
        return False


def test_transferred_hidden_state_and_logits_equal_a_local_prefill(monkeypatch):
    from transformers import AutoTokenizer

    from backend.disagg.auth import SECRET_ENV, new_secret
    from backend.serving.config import InstanceConfig

    monkeypatch.setenv(SECRET_ENV, new_secret())  # both workers of this deployment share it
    from backend.serving.decode_worker import DecodeWorker
    from backend.serving.prefill_worker import PrefillWorker

    model = str(real_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model)
    # no prefix caching: the local prefill below computes the prompt in the prefill instance's chunks
    # (with the prompt's pages cached it would compute only its last few tokens, in products of fewer
    # rows, which may take another product path: int4w's groups up to 16 rows, bfloat16 or float16
    # beyond, whose last digits differ)
    common = {
        "model_path": model,
        "kv_cache_tokens": "2048",
        "max_num_batched_tokens": "64",
        "num_threads": "1",
        "enable_prefix_caching": "false",
    }
    prefill = PrefillWorker(InstanceConfig.from_parameters({**common, "role": "prefill"}), "meta_prefill")
    decode = DecodeWorker(
        InstanceConfig.from_parameters(
            {**common, "role": "decode", "prefill_endpoints": f"127.0.0.1:{prefill.server.port}"}
        ),
        "meta_decode",
    )
    try:
        received = {}
        forward = decode._kv_done  # the decode loop applying a KVDone event

        def spy(req_id, ok, err, state):
            received[req_id] = (ok, err, None if state is None else (state[0].clone(), state[1].clone()))
            forward(req_id, ok, err, state)

        decode._kv_done = spy
        prompt = tokenizer.encode("Read the list and answer. " + " ".join(f"Item {i} is {i * 7}." for i in range(30)))
        sink = Sink()
        request = ClientRequest(text="-", max_tokens=8, ignore_eos=True, num_draft_tokens=3, draft_method="hidden")
        session = GenerationSession(
            "m0", request, prompt, sink, IncrementalDetokenizer(tokenizer, []), cancel_engine=decode.cancel
        )
        decode.submit(session)
        assert sink.done.wait(120) and sink.error is None, sink.error
        assert len(sink.token_ids) == 8
        ok, err, state = received["m0"]
        assert ok and state is not None, err
        hidden, logits = state

        local, finished = {}, threading.Event()

        def on_output(out):
            if out.finished:
                local["out"] = out
                finished.set()

        decode.loop.submit("m0-local", prompt[:-1], None, on_output, prefill_only=True)
        assert finished.wait(120) and local["out"].finish_reason == FinishReason.PREFILL_DONE
        decode.loop.release("m0-local")
        assert (hidden - local["out"].hidden_state.float()).abs().max() <= TOLERANCE
        assert (logits - local["out"].logits.float()).abs().max() <= TOLERANCE
        assert int(logits.argmax()) == int(local["out"].logits.argmax())
    finally:
        decode.shutdown()
        prefill.shutdown()
