"""The emulated engine (backend/engine/emulated_runner.py): the real engine around a runner that
waits what an engine profile says a step takes and makes its tokens from a hash chain kept in the
KV cache. Its tokens are deterministic and continue token for token across the prefix cache,
chunked prefill and a resumed request; a page whose contents are lost changes them; its steps
take the profile's time, spread over the layers with the per-layer hook; it loads no model
(transformers is not imported); a profile that does not exist is refused, naming the shipped ones.
The end-to-end check (served, both modes, KV over NIXL) is tests/integration/test_emulated_deployment.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend.engine.config import EngineConfig
from backend.engine.emulated_runner import SEED, EmulatedRunner, generate, mix, next_token
from backend.engine.llm_engine import LLMEngine
from backend.engine.protocol import BatchEntry
from backend.engine.sampling_params import SamplingParams
from backend.engine.step_profile import PROFILES

ROOT = Path(__file__).resolve().parents[2]
PROFILE = sorted(p.stem for p in PROFILES.glob("*.json"))[0]
VOCAB, LAYERS, EOS = 500, 3, 2


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A checkpoint folder as far as the emulated engine reads one: its config.json."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"vocab_size": VOCAB, "num_hidden_layers": LAYERS, "eos_token_id": EOS, "max_position_embeddings": 1024}
        )
    )
    return tmp_path


def engine(checkpoint: Path, **kw) -> LLMEngine:
    config = EngineConfig(**(dict(model_path=str(checkpoint), emulate=PROFILE, kv_cache_tokens=1024, page_size=4) | kw))
    return LLMEngine(config, EmulatedRunner(config, sleep=lambda s: None))


def run(e: LLMEngine, prompts: dict[str, list[int]], n: int, **params) -> dict[str, list[int]]:
    for req_id, prompt in prompts.items():
        e.add_request(req_id, prompt, SamplingParams(max_tokens=n, **params))
    out: dict[str, list[int]] = {k: [] for k in prompts}
    while e.has_work():
        for o in e.step():
            out[o.req_id].extend(o.new_token_ids)
            if o.finished:
                e.release(o.req_id)
    return out


PROMPT = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41]


def expected(prompt: list[int], n: int) -> list[int]:
    return generate(prompt, n, VOCAB, frozenset({EOS}))


def test_tokens_follow_the_hash_chain_through_cache_chunks_and_a_resume(checkpoint):
    want = expected(PROMPT, 12)
    assert EOS not in want and len(set(want)) > 6
    e = engine(checkpoint)
    assert run(e, {"a": PROMPT}, 12) == {"a": want}
    # again: the prompt's full pages come from the prefix cache, the chain is read back from them
    hits = e.pool_stats()["prefix_hit_tokens"]
    assert run(e, {"b": PROMPT}, 12) == {"b": want}
    assert e.pool_stats()["prefix_hit_tokens"] >= hits + 8  # two full pages of 4
    # prefill in chunks of 3 tokens, beside another request, sampled: the same tokens
    e = engine(checkpoint, max_num_batched_tokens=3)
    got = run(e, {"c": PROMPT, "d": [5, 6]}, 12, temperature=1.5, seed=3)
    assert got["c"] == want and got["d"] == expected([5, 6], 12)
    # a resumed request (the prompt and the tokens already sent) continues where it was
    assert run(engine(checkpoint), {"r": PROMPT + want[:5]}, 7) == {"r": want[5:]}


def test_a_lost_page_changes_the_tokens_from_there(checkpoint):
    e = engine(checkpoint, enable_prefix_caching=True)
    run(e, {"a": PROMPT}, 4)  # the prompt's pages stay in the prefix cache
    e.pool.tensor.zero_()  # what a transfer that never landed leaves
    assert run(e, {"b": PROMPT}, 4)["b"] != expected(PROMPT, 4)


def test_a_step_waits_the_profiles_time_spread_over_the_layers(checkpoint):
    cfg = EngineConfig(model_path=str(checkpoint), emulate=PROFILE, kv_cache_tokens=1024, page_size=4)
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    runner = EmulatedRunner(cfg, clock=lambda: now[0], sleep=sleep)
    hooked: list[tuple[int, object, float]] = []
    runner.set_layer_hook(lambda layer, arg, mark: hooked.append((layer, arg, now[0])) or mark.wait())
    entries = [BatchEntry(PROMPT, 0, [0, 1, 2]), BatchEntry([3], 6, [3, 4])]
    result = runner.run(entries, hook_arg="step")
    total = runner.cost.step_time([(10, 0), (1, 6)])
    assert total > 0 and sum(slept) == pytest.approx(total)
    # each layer's hook fires as its KV is written, before that layer's share of the wait
    assert [(layer, arg) for layer, arg, _ in hooked] == [(layer, "step") for layer in range(LAYERS)]
    assert [t for _, _, t in hooked] == pytest.approx([100.0 + total * layer / LAYERS for layer in range(LAYERS)])
    assert result.logits.shape == (2, VOCAB) and result.hidden.shape[0] == 2
    assert int(result.logits[0].argmax()) == expected(PROMPT, 1)[0]
    # several positions' logits (a speculative step verifies its drafts with them)
    result = runner.run([BatchEntry(PROMPT, 0, [0, 1, 2])], num_logits=[3])
    assert result.position_logits is not None and result.position_logits[0].shape == (3, VOCAB)
    h = SEED
    chain = []
    for t in PROMPT:
        h = mix(h, t)
        chain.append(next_token(h, VOCAB, frozenset({EOS})))
    assert result.position_logits[0].argmax(dim=1).tolist() == chain[-3:]


def test_an_unknown_profile_is_refused_naming_the_shipped_ones(checkpoint):
    with pytest.raises(ValueError, match=rf"no such file, and not one of the shipped profiles .*{PROFILE}"):
        EngineConfig(model_path=str(checkpoint), emulate="no-such-gpu")
    with pytest.raises(ValueError, match="one process"):
        EngineConfig(model_path=str(checkpoint), emulate=PROFILE, tensor_parallel_size=2)
    cfg = EngineConfig(model_path=str(checkpoint), emulate=PROFILE)
    assert (cfg.weights_format, cfg.kv_format) == ("float32", "float32")
    assert cfg.weights_choice == "emulated: no weights are loaded"


def test_the_emulated_engine_loads_no_model(checkpoint):
    code = (
        "import sys; from backend.engine.config import EngineConfig; from backend.engine.llm_engine import LLMEngine;"
        f"LLMEngine(EngineConfig(model_path={str(checkpoint)!r}, emulate={PROFILE!r}, kv_cache_tokens=256));"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'safetensors'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_shipped_profile_loads_and_says_its_source():
    from backend.engine.step_profile import EngineProfile

    shipped = sorted(PROFILES.glob("*.json"))
    assert shipped
    for path in shipped:
        profile = EngineProfile.load(path)
        assert profile.source, path.name
        cost = profile.cost(min(profile.threads))
        # a decode step grows with the batch and with the context; a long prompt takes longer
        assert cost.step_time([(1, 128)]) < cost.step_time([(1, 128)] * 32) < cost.step_time([(1, 4096)] * 32)
        assert cost.step_time([(128, 0)]) < cost.step_time([(2048, 0)])
