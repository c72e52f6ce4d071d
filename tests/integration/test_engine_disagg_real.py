"""Disaggregation hooks inside one process on the real checkpoint: a prefill-only engine fills
pages, a per-layer hook copies them into the pages a decode engine admitted (standing in for the
NIXL writes), and the decode engine continues from the last prompt token: token for token the
aggregated engine's, with the hidden state and logits of transformers."""

from __future__ import annotations

import torch
from engine_helpers import (
    Listener,
    admit_remote,
    assert_pool_idle,
    make_engine,
    real_model_dir,
    run_to_completion,
    tokens_of,
)

from backend.engine.outputs import FinishReason
from backend.engine.protocol import BatchEntry
from backend.engine.sampling_params import SamplingParams

LOGIT_TOLERANCE = 1e-3


class PageStreamer:
    """Per-layer hook of the prefill engine: copies each chunk's touched pages of that layer into the
    decode engine's reserved pages, as the transfer engine will (one copy per page per layer)."""

    def __init__(self, prefill_engine, decode_engine):
        self.src = prefill_engine
        self.dst = decode_engine
        self.dst_pages: dict[str, list[int]] = {}
        self.scheduled = []
        self.page_writes = 0
        prefill_engine.set_kv_listener(Listener(self.scheduled.append, self.on_layer))

    def on_layer(self, layer_idx, step_batch):
        page_size = self.src.config.page_size
        for chunk in step_batch.prefill_only_chunks:
            first_logical = chunk.start // page_size
            dst = self.dst_pages[chunk.req_id][first_logical : first_logical + len(chunk.page_ids)]
            for src_page, dst_page in zip(chunk.page_ids, dst):
                self.dst.pool.layer(layer_idx)[dst_page].copy_(self.src.pool.layer(layer_idx)[src_page])
                self.page_writes += 1


def disaggregated_generate(
    prefill, decode, streamer, requests: dict[str, tuple[list[int], SamplingParams]], before_decode=None
):
    """Run requests through prefill -> page copy -> decode; returns (decode outputs, prefill outputs)."""
    for req_id, (prompt, params) in requests.items():
        streamer.dst_pages[req_id] = admit_remote(decode, req_id, prompt, params)
        prefill.add_request(req_id, prompt[:-1], prefill_only=True)
    prefill_outputs = run_to_completion(prefill)
    for req_id, (prompt, _params) in requests.items():
        assert prefill_outputs[req_id][-1].finish_reason == FinishReason.PREFILL_DONE
        assert prefill.release(req_id) == -(-(len(prompt) - 1) // prefill.config.page_size)
        if before_decode is not None:
            before_decode(req_id, prompt)
        assert decode.kv_loaded(req_id)
    return run_to_completion(decode), prefill_outputs


# --- tiny model: hook mechanics ---------------------------------------------------------------


# --- real model: prefill engine -> decode engine ----------------------------------------------


def test_real_disaggregated_equals_aggregated_and_hidden_state_matches():
    model_dir = real_model_dir()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    long_question = (
        "Summarise the following notes in one sentence. The meeting covered the quarterly budget, "
        "the hiring plan for the data team, the migration of the build servers to the new cluster, "
        "and the schedule for the security audit. Everyone agreed to send comments by Friday."
    )
    prompts = {
        "long": tokenizer.apply_chat_template(
            [{"role": "user", "content": long_question}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"],
        "short": tokenizer("The capital of Italy is")["input_ids"],
    }
    budget = 32
    assert len(prompts["long"]) - 1 > 2 * budget  # three or more prefill chunks
    params = SamplingParams(max_tokens=16)

    aggregated = make_engine(model_dir, max_num_batched_tokens=budget)
    for req_id, prompt in prompts.items():
        aggregated.add_request(req_id, prompt, params)
    expected = {r: tokens_of(o) for r, o in run_to_completion(aggregated).items()}
    del aggregated

    prefill = make_engine(model_dir, max_num_batched_tokens=budget)
    decode = make_engine(model_dir, max_num_batched_tokens=budget)
    streamer = PageStreamer(prefill, decode)
    checks = {}

    def recompute_on_decode_side(req_id, prompt):  # before decoding starts: position n-2 over copied pages
        pages = streamer.dst_pages[req_id]
        checks[req_id] = decode.runner.run([BatchEntry([prompt[-2]], len(prompt) - 2, pages)])

    decode_outputs, prefill_outputs = disaggregated_generate(
        prefill, decode, streamer, {r: (p, params) for r, p in prompts.items()}, before_decode=recompute_on_decode_side
    )
    assert {r: tokens_of(o) for r, o in decode_outputs.items()} == expected
    assert "Rome" in tokenizer.decode(expected["short"])
    long_chunks = [c for batch in streamer.scheduled for c in batch.prefill_only_chunks if c.req_id == "long"]
    assert len(long_chunks) >= 3 and long_chunks[-1].is_last_chunk

    # The prefill side's hidden state / logits at the last position of prompt[:-1] equal what the decode
    # side computes for that position from the copied pages, and transformers' forward there.
    for req_id, prompt in prompts.items():
        pos = len(prompt) - 2
        check = checks[req_id]
        out = prefill_outputs[req_id][-1]
        assert (out.logits - check.logits[0]).abs().max().item() < LOGIT_TOLERANCE
        assert (out.hidden_state - check.hidden[0]).abs().max().item() < LOGIT_TOLERANCE
        with torch.inference_mode():
            reference = hf_model.model(torch.tensor([prompt[:-1]])).last_hidden_state[0, pos]
        assert (out.hidden_state - reference).abs().max().item() < LOGIT_TOLERANCE
    for engine in (prefill, decode):
        assert_pool_idle(engine)
