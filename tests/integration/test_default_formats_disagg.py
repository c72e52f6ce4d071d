"""``serve``'s default formats end to end (the suite's other server tests pin float32 weights, which
keep an exact float32 pool): ``weights_dtype=auto`` and ``kv_dtype=auto``, so a float16 KV pool on
this CPU under the 4-bit formats, through a real disaggregated deployment with real NIXL: the
instances log the pool's dtype and why; a prompt's float16 KV computed by the prefill instance
and sent page by page to the decode instance gives the greedy tokens of the aggregated model on
the same formats, and its output log-probabilities within 2e-3, for prompts prefilled in several
chunks; the transfer moves float16 pages (half float32's bytes). Not within float32's 1e-4
(``test_logprobs_server.py``), and not because of the pool: the aggregated instance computes the
prompt's last token inside a prefill chunk (bfloat16 products over many rows), the decode instance
as its first decode step (4-bit products, int16 activations); measured 5.5e-4 at most here with a
float16 pool, 1.1e-3 with a float32 one."""

from __future__ import annotations

import numpy as np

from backend.client import stream_generate
from backend.engine.config import EngineConfig
from tests.conftest import PROMPTS, deployment_server, settled_metric


def test_default_formats_give_the_same_tokens_and_log_probs_in_both_modes(model_dir, tmp_path_factory):
    config = EngineConfig(model_path=str(model_dir))  # what the instances resolve on this CPU
    print(f"weights {config.weights_format} ({config.weights_choice}); KV {config.kv_format} ({config.kv_choice})")
    overrides = {"weights_dtype": "auto", "kv_cache_tokens": "4096", "max_num_batched_tokens": "64"}
    with deployment_server(
        tmp_path_factory,
        "default-formats",
        mode="disagg",
        model_path=str(model_dir),
        with_aggregated=True,
        overrides=overrides,
        timeout_s=400,
    ) as server:
        log = server.log_file.read_text()
        assert f"{config.kv_format} KV (auto: " in log or config.kv_choice == "", log[-3000:]
        kw = dict(ignore_eos=True, log_probs=True, top_log_probs=2)
        for prompt in (PROMPTS[6], PROMPTS[7]):  # several prefill chunks at the 64-token budget
            disagg = stream_generate(server.grpc_url, prompt, 12, model="llm", **kw)
            agg = stream_generate(server.grpc_url, prompt, 12, model="llm_aggregated", **kw)
            assert disagg.error is None and agg.error is None, (disagg.error, agg.error)
            assert disagg.token_ids == agg.token_ids
            np.testing.assert_allclose(
                disagg.log_probs["output_log_probs"], agg.log_probs["output_log_probs"], atol=2e-3, rtol=0
            )
        # read once it stops moving: read at once, it was 41.4 pages' bytes in a CI run (its last layers posted,
        # not yet exported)
        sent = settled_metric(server.metrics_url, "triton_disagg_kv_transfer_bytes_total", model="prefill_0")
        assert sent > 0, "no KV crossed the fabric"
        page_bytes = 30 * 2 * 3 * 16 * 64 * (2 if config.kv_format == "float16" else 4)  # SmolLM2's page
        assert sent % page_bytes == 0, (sent, page_bytes)  # whole pages of the pool's dtype
