"""The emulated engine served (``--set emulate=PROFILE``): real ``tritonserver`` deployments,
aggregated and disaggregated (1 prefill + 1 decode instance, every prefill over the KV fabric:
real NIXL between the two), whose instances load no model and wait what the engine profile says
each step takes. Concurrent streams through Triton's gRPC API give exactly the emulated engine's
tokens for their prompts in both modes: in the disaggregated one the decode instance's first token
comes from the hash chain the prefill instance wrote into pages that crossed the fabric, so a page
lost or misplaced on the way would show. It prints each stub's memory and the streams' mean
inter-token gap beside the profile's step time (figures, not bounds)."""

from __future__ import annotations

import pytest

from backend.client import ConcurrentStreams
from backend.engine.emulated_runner import checkpoint_shape, generate
from backend.engine.step_profile import EngineProfile, profile_path
from tests.conftest import deployment_server

pytestmark = pytest.mark.usefixtures("nixl")

PROFILE = "h100-llama-3.1-8b-fp8-trtllm"
N_TOKENS = 48
PROMPTS = [
    "Explain how a paged KV cache works.",
    "Name three rivers of Europe and where they end.",
    "Write a haiku about a decode instance that never waits for a prefill.",
    " ".join(f"item {i} costs {3 * i} coins;" for i in range(60)),  # several pages, chunked prefill
]


@pytest.fixture(scope="module", params=["aggregated", "disagg"])
def server(request, model_dir, tmp_path_factory):
    with deployment_server(
        tmp_path_factory,
        f"emulated-{request.param}",
        mode=request.param,
        model_path=str(model_dir),
        overrides={"emulate": PROFILE, "kv_cache_tokens": "4096", "max_num_batched_tokens": "128"},
    ) as s:
        yield s


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def test_streams_give_the_emulated_tokens_in_both_modes(server, tokenizer, model_dir):
    vocab, _, end_ids = checkpoint_shape(str(model_dir))
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    results = ConcurrentStreams(server.grpc_url, prompts, N_TOKENS, timeout_s=120).join()
    assert [r.error for r in results] == [None] * len(prompts), [r.error for r in results]
    for prompt, r in zip(prompts, results):
        assert r.token_ids == generate(prompt, N_TOKENS, vocab, frozenset(end_ids)), len(prompt)
    # sampled, the generator's token still has all the probability
    (r,) = ConcurrentStreams(server.grpc_url, prompts[:1], 8, temperature=1.3, seed=5).join()
    assert r.error is None and r.token_ids == generate(prompts[0], 8, vocab, frozenset(end_ids))
    profile = EngineProfile.load(profile_path(PROFILE))
    cost = profile.cost(min(profile.threads))
    gaps = [b - a for x in results for a, b in zip(x.times[1:], x.times[2:])]
    print(
        f"mean inter-token gap {1e3 * sum(gaps) / len(gaps):.1f} ms; the profile's decode step of "
        f"{len(prompts)} sequences at ~{len(prompts[-1])} tokens: "
        f"{1e3 * cost.step_time([(1, len(p) + N_TOKENS // 2) for p in prompts]):.1f} ms"
    )
    for name, pid in sorted(server.instance_pids().items()):
        print(f"stub {name}: {_rss_mib(pid):.0f} MiB resident")
