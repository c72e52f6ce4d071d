"""Disaggregation hooks inside one process: a prefill-only engine fills pages, a per-layer hook copies
them into pages reserved in a decode engine (standing in for the NIXL writes), and the decode engine
continues from the last prompt token. Must equal the aggregated engine token for token."""

from __future__ import annotations

import pytest
from engine_helpers import (
    Listener,
    admit_remote,
    assert_pool_idle,
    build_tiny_llama,
    make_engine,
    run_to_completion,
    tokens_of,
)

from backend.engine.outputs import FinishReason
from backend.engine.sampling_params import SamplingParams


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


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_disagg"))


def test_chunk_hook_reports_chunks_and_pages(tiny_dir):
    engine = make_engine(tiny_dir, max_num_batched_tokens=16, page_size=8, kv_cache_tokens=512)
    seen, layer_calls = [], []
    engine.set_kv_listener(
        Listener(
            lambda batch: seen.append(batch.prefill_only_chunks),
            lambda layer, batch: layer_calls.append((layer, len(batch.chunks))),
        )
    )
    engine.add_request("agg", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    run_to_completion(engine)
    assert seen == [] and layer_calls == [(0, 1), (1, 1)] * 2  # aggregated requests: no chunk hook

    engine.add_request("pf", list(range(3, 43)), prefill_only=True)
    outputs = run_to_completion(engine)["pf"]
    pages = engine.allocator.page_table("pf")
    assert [[(c.req_id, c.start, c.num_tokens, c.page_ids, c.is_last_chunk) for c in chunks] for chunks in seen] == [
        [("pf", 0, 16, pages[0:2], False)],
        [("pf", 16, 16, pages[2:4], False)],
        [("pf", 32, 8, pages[4:5], True)],
    ]
    assert len(layer_calls) == 2 * 2 + 3 * 2
    out = outputs[-1]
    assert (
        len(outputs) == 1
        and out.finished
        and out.new_token_ids == []
        and out.finish_reason == FinishReason.PREFILL_DONE
    )
    assert out.hidden_state.shape == (64,) and out.logits.shape == (256,)
    assert engine.pool_stats()["used"] == 5  # held until release
    assert engine.release("pf") == 5 and engine.release("pf") == 0
    assert_pool_idle(engine)


def test_prefill_only_abort_keeps_pages_until_release(tiny_dir):
    engine = make_engine(tiny_dir, max_num_batched_tokens=16, page_size=8, kv_cache_tokens=512)
    engine.add_request("pf", list(range(3, 60)), prefill_only=True)
    engine.step()
    assert engine.abort("pf").finish_reason == "abort"
    assert engine.pool_stats()["used"] > 0  # a transfer may still be reading these pages
    with pytest.raises(ValueError, match="remote_kv and prefill_only"):
        engine.add_request("x", [1, 2, 3], prefill_only=True, remote_kv=True)
    engine.release("pf")
    assert_pool_idle(engine)


def test_tiny_disaggregated_equals_aggregated(tiny_dir):
    prompts = {"a": list(range(3, 60)), "b": [9, 8, 7, 6], "c": list(range(100, 133))}
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    aggregated = make_engine(tiny_dir, max_num_batched_tokens=16, page_size=8)
    for req_id, prompt in prompts.items():
        aggregated.add_request(req_id, prompt, params)
    expected = {r: tokens_of(o) for r, o in run_to_completion(aggregated).items()}
    prefill = make_engine(tiny_dir, max_num_batched_tokens=16, page_size=8)
    decode = make_engine(tiny_dir, max_num_batched_tokens=16, page_size=8)
    streamer = PageStreamer(prefill, decode)
    decode_outputs, _ = disaggregated_generate(prefill, decode, streamer, {r: (p, params) for r, p in prompts.items()})
    assert {r: tokens_of(o) for r, o in decode_outputs.items()} == expected
    assert streamer.page_writes > 0
    for engine in (prefill, decode):
        assert_pool_idle(engine)


# --- real model: prefill engine -> decode engine ----------------------------------------------
