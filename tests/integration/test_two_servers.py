"""One deployment across two Triton servers, reached through both APIs (real etcd, real
tritonservers, real NIXL, the real model):

server A: 1 prefill + 1 decode instance and the front model ``llm`` (mode disagg); server B: 1
decode instance and its own front (mode decode, its prefill instance found in the membership:
A's); both sign their records with one secret. The OpenAI frontend (``--discovery``) and both
front models know the decode instances only from etcd.

- 6 concurrent completions through the OpenAI frontend reach both servers' decode instances and
  equal transformers' greedy output; the same through server A's Triton API (its front model);
- a record written into etcd with the wrong signature (pointing at a real decode model) is never
  routed to, and the frontend logs it;
- kill -9 of a decode instance serving some of 4 long greedy streams after about 30 tokens: every
  stream completes, each equal to transformers' output (no token repeated or lost), and the
  frontend's ``triton_disagg_migrations_total`` counts the moves; a fifth stream with echo and
  logprobs gets the prompt's log-probabilities once and every output token's, equal to
  transformers' (it moves when the killed instance served it);
- kill -9 of server B's whole ``tritonserver`` while it serves some of 6 greedy streams of 150
  tokens, through server A's Triton API and then through the OpenAI API: every stream
  completes equal to transformers' output, the moves are counted; B is started again (and both
  decode instances routed to) before the next test that needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch

from backend.client import ConcurrentStreams
from backend.cluster.etcd import EtcdClient
from backend.cluster.records import InstanceRecord, decode, encode, key_of, prefix_of
from backend.disagg.auth import SECRET_ENV, new_secret
from backend.launch.openai_frontend import OpenAIFrontend
from backend.launch.server import TritonServer
from backend.serving.request import prompt_token_ids
from tests.conftest import (
    EXACT,
    PROMPTS,
    REMOTE_PREFILL,
    generate_concurrently,
    hf_greedy,
    metric_values,
    private_etcd,
    read_metrics,
    wait_metric,
)

pytestmark = pytest.mark.usefixtures("nixl")

MODEL = "smollm2"
OVERRIDES = {
    **REMOTE_PREFILL,
    **EXACT,
    "kv_cache_tokens": "8192",
    "num_threads": "1",
    "max_num_batched_tokens": "256",
    "kv_transfer_timeout_s": "15",
    "kv_quarantine_s": "3",
}


@dataclasses.dataclass
class Cluster:
    a: TritonServer
    b: TritonServer
    frontend: OpenAIFrontend
    etcd_url: str
    secret: str

    @property
    def metrics(self) -> str:
        return f"{self.frontend.url}/metrics"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.frontend.url}/v1", api_key="none", max_retries=0, timeout=300)

    def targets_up(self) -> dict[str, float]:
        """target name -> 1 while the frontend routes to it (from its /metrics)."""
        return {
            dict(labels)["target"]: value
            for (name, labels), value in read_metrics(self.metrics).items()
            if name == "triton_disagg_decode_target_up"
        }

    def migrations(self) -> float:
        return sum(metric_values(self.metrics, "triton_disagg_migrations_total"))


class OpenAIStreams:
    """Greedy streamed completions through the OpenAI frontend, one thread each (not started):
    what each received (chunks, text) and the error it ended with."""

    def __init__(self, client: openai.OpenAI, prompts: list[str], n_tokens: int):
        self.received = [0] * len(prompts)
        self.texts = [""] * len(prompts)
        self.errors: list = [None] * len(prompts)

        def run(i: int) -> None:
            try:
                chunks = client.completions.create(
                    model=MODEL,
                    prompt=prompts[i],
                    max_tokens=n_tokens,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for chunk in chunks:
                    if chunk.choices and chunk.choices[0].text:
                        self.texts[i] += chunk.choices[0].text
                        self.received[i] += 1
            except Exception as e:  # noqa: BLE001 - asserted by the tests
                self.errors[i] = e

        self.threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]


def _start_all(servers: list[TritonServer], timeout_s: float) -> None:
    """Start the servers side by side (each loads its models meanwhile); raise the first failure."""
    errors: list[BaseException] = []

    def start(server: TritonServer) -> None:
        try:
            server.start(timeout_s=timeout_s)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        raise errors[0]


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    from backend.launch.deployment import render_deployment

    tmp = tmp_path_factory.mktemp("openai-router")
    secret = {SECRET_ENV: new_secret()}  # two servers and the frontend: one deployment secret
    with private_etcd(tmp) as etcd, contextlib.ExitStack() as stack:
        common = dict(model_path=str(model_dir), overrides=OVERRIDES, discovery=etcd.url, decode_instances=1)
        repo_a = render_deployment(tmp / "a", mode="disagg", prefill_instances=1, **common)
        repo_b = render_deployment(tmp / "b", mode="decode", **common)
        a = TritonServer(repo_a, log_file=tmp / "a.log", extra_env=secret)
        b = TritonServer(repo_b, log_file=tmp / "b.log", extra_env=secret)
        stack.callback(lambda: print(f"tritonserver logs: {tmp / 'a.log'}, {tmp / 'b.log'}"))
        stack.callback(a.stop)
        stack.callback(b.stop)  # stopped first: it uses A's prefill instance
        _start_all([a, b], timeout_s=400)
        frontend = OpenAIFrontend(
            a.grpc_url,  # not used with discovery
            model_dir,
            served_model_name=MODEL,
            discovery=etcd.url,
            extra_env=secret,
            log_file=tmp / "openai.log",
        )
        frontend.start()
        stack.callback(frontend.stop)
        found = Cluster(a, b, frontend, etcd.url, secret[SECRET_ENV])
        deadline = time.monotonic() + 60
        while sorted(found.targets_up().values()) != [1.0, 1.0]:
            assert time.monotonic() < deadline, (
                f"the frontend does not route to both decode instances: {found.targets_up()}"
            )
            time.sleep(0.3)
        yield found


def requests_total(server: TritonServer) -> float:
    return sum(metric_values(server.metrics_url, "triton_disagg_requests_total", model="decode_0"))


def active(server: TritonServer) -> float:
    return sum(metric_values(server.metrics_url, "triton_disagg_requests_active", model="decode_0"))


def served_since(cluster: Cluster, before: tuple[float, float]) -> tuple[float, float]:
    """Decode requests each server finished since ``before`` (waits for its metrics' refresh)."""
    deadline = time.monotonic() + 5
    while True:
        served = requests_total(cluster.a) - before[0], requests_total(cluster.b) - before[1]
        if min(served) > 0 or time.monotonic() > deadline:
            return served
        time.sleep(0.2)


def test_completions_spread_over_both_servers(cluster, tokenizer, hf_model):
    client = cluster.client()
    before = requests_total(cluster.a), requests_total(cluster.b)
    prompts = PROMPTS[:6]

    def complete(prompt: str) -> str:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None and out.usage.completion_tokens == 16
        return out.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(complete, prompts))
    for prompt, text in zip(prompts, texts):
        want = hf_greedy(hf_model, prompt_token_ids(tokenizer, prompt, False), 16)
        assert text == tokenizer.decode(want, skip_special_tokens=True), prompt
    served = served_since(cluster, before)
    print(f"decode requests: server A {served[0]:.0f}, server B {served[1]:.0f}")
    assert min(served) > 0 and sum(served) == len(prompts), served
    assert [m.id for m in client.models.list().data] == [MODEL]
    # the frontend is a member too (role "router"), signed like the instances
    _, routers = EtcdClient(cluster.etcd_url).get_prefix(prefix_of("default", "router"))
    assert len(routers) == 1 and decode(next(iter(routers.values())), cluster.secret).model == "openai"


def test_a_record_with_the_wrong_signature_is_never_routed_to(cluster):
    genuine = set(cluster.targets_up())
    etcd = EtcdClient(cluster.etcd_url)
    forged = InstanceRecord(
        deployment="default",
        name="forged-decode",
        role="decode",
        grpc_url=cluster.b.grpc_url,  # a real decode model: were the record taken, it would be used
        model="decode_0",
        messenger="",
        model_identity="x",
        kv_layout="y",
        tp_size=1,
        started_at=time.time(),
    )
    key = key_of(forged)
    etcd.put(key, encode(forged, new_secret()))
    etcd.put(prefix_of("default", "decode") + "garbage", b"{not a record")
    try:
        time.sleep(2.5)  # the watch delivers at once; a probe round is 1 s
        client = cluster.client()

        def complete(prompt: str) -> int:
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
            return out.usage.completion_tokens if out.usage else 0

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, PROMPTS[:4])) == [4] * 4
        assert set(cluster.targets_up()) == genuine
        routed = {
            dict(labels)["target"]
            for (name, labels), _ in read_metrics(cluster.metrics).items()
            if name == "triton_disagg_requests_routed_total"
        }
        assert routed == genuine
        assert cluster.frontend.proc is not None and cluster.frontend.proc.poll() is None
        assert requests.get(f"{cluster.frontend.url}/health", timeout=5).status_code == 200
    finally:
        etcd.delete(key)
        etcd.delete(prefix_of("default", "decode") + "garbage")
    log = cluster.frontend.log_file.read_text() if cluster.frontend.log_file else ""
    assert f"ignoring the record at {key}" in log and "wrong signature" in log


N_TOKENS = 140


def test_streams_move_when_their_decode_instance_is_killed(cluster, tokenizer, hf_model):
    prompts = PROMPTS[:4]
    streams = OpenAIStreams(cluster.client(), prompts, N_TOKENS)
    received, texts, errors = streams.received, streams.texts, streams.errors
    before = cluster.migrations()

    # and one more stream, greedy with echo and logprobs: the prompt's log-probabilities reach the
    # client once, and every output token's, across the move
    scored = tokenizer.encode("The capital of France is", add_special_tokens=False)
    pieces: list[dict] = []

    def stream_logprobs() -> None:
        body = {"model": MODEL, "prompt": [scored], "max_tokens": N_TOKENS, "temperature": 0, "logprobs": 1}
        body |= {"echo": True, "ignore_eos": True, "stream": True}
        try:
            with requests.post(f"{cluster.frontend.url}/v1/completions", json=body, stream=True, timeout=300) as r:
                assert r.status_code == 200, r.text
                for line in r.iter_lines():
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        event = json.loads(line[len(b"data: ") :])
                        assert "error" not in event, event
                        if event["choices"] and event["choices"][0]["logprobs"]:
                            pieces.append(event["choices"][0]["logprobs"])
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = streams.threads + [threading.Thread(target=stream_logprobs)]
    [t.start() for t in threads]
    deadline = time.monotonic() + 120
    while min(received) < 30 or len(pieces) < 20 or not (active(cluster.a) or active(cluster.b)):
        assert time.monotonic() < deadline, (received, active(cluster.a), active(cluster.b))
        time.sleep(0.05)
    victim, name = (cluster.a, "A") if active(cluster.a) >= active(cluster.b) else (cluster.b, "B")
    on_victim = active(victim)
    os.kill(victim.instance_pids()["decode_0_0_0"], signal.SIGKILL)
    at_kill = list(received)
    [t.join(300) for t in threads]
    assert errors == [None] * len(prompts)
    for prompt, text in zip(prompts, texts):
        want = hf_greedy(hf_model, prompt_token_ids(tokenizer, prompt, False), N_TOKENS)
        assert text == tokenizer.decode(want, skip_special_tokens=True), prompt
    with_prompt = [p for p in pieces if p["token_logprobs"] and p["token_logprobs"][0] is None]
    assert len(with_prompt) == 1 and pieces[0] is with_prompt[0] and len(pieces[0]["tokens"]) == len(scored)
    out_tokens = [t for p in pieces[1:] for t in p["tokens"]]
    out_lps = [v for p in pieces[1:] for v in p["token_logprobs"]]
    full = scored + hf_greedy(hf_model, scored, N_TOKENS)
    assert out_tokens == [tokenizer.decode([t]) for t in full[len(scored) :]]  # nothing repeated or lost
    with torch.inference_mode():
        table = hf_model(input_ids=torch.tensor([full])).logits[0].float().log_softmax(-1)
    want = [float(table[i, full[i + 1]]) for i in range(len(scored) - 1, len(full) - 1)]
    assert out_lps == pytest.approx(want, abs=1e-3)
    moved = cluster.migrations() - before
    print(
        f"killed server {name}'s decode instance with {on_victim:.0f} stream(s) on it at {at_kill}; {moved:.0f} moved"
    )
    assert moved >= on_victim >= 1


def front_targets_up(server: TritonServer) -> list[float]:
    """The front model ``llm``'s decode_target_up gauges on ``server``."""
    return metric_values(server.metrics_url, "triton_disagg_decode_target_up", model="llm")


def front_migrations(server: TritonServer) -> float:
    return sum(metric_values(server.metrics_url, "triton_disagg_migrations_total", model="llm"))


def wait_all_up(cluster: Cluster, timeout_s: float = 120) -> None:
    """Until the OpenAI frontend and server A's front model route to both decode instances
    (and to nothing else: a killed instance's record is gone)."""
    deadline = time.monotonic() + timeout_s
    while sorted(cluster.targets_up().values()) != [1.0, 1.0] or sorted(front_targets_up(cluster.a)) != [1.0, 1.0]:
        assert time.monotonic() < deadline, (cluster.targets_up(), front_targets_up(cluster.a))
        time.sleep(0.3)


def test_the_triton_api_reaches_both_servers(cluster, tokenizer, hf_model):
    both_up(cluster)
    before = requests_total(cluster.a), requests_total(cluster.b)
    prompts = PROMPTS[:6]
    results = generate_concurrently(cluster.a.grpc_url, prompts, "llm", 16)
    assert [r.error for r in results] == [None] * len(prompts)
    for prompt, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(hf_model, prompt_token_ids(tokenizer, prompt, False), 16), prompt
    served = served_since(cluster, before)
    print(f"decode requests through A's Triton API: server A {served[0]:.0f}, server B {served[1]:.0f}")
    assert min(served) > 0 and sum(served) == len(prompts), served


SERVER_KILL_TOKENS = 150


def kill_server_b_under(cluster: Cluster, received: list[int], migrations) -> tuple[float, float]:
    """Once every stream has 30 tokens and server B serves some of them, kill -9 its
    tritonserver. Returns (B's streams then, the migration count before)."""
    deadline = time.monotonic() + 120
    while min(received) < 30 or not active(cluster.b):
        assert time.monotonic() < deadline, (received, active(cluster.a), active(cluster.b))
        time.sleep(0.05)
    on_b, before = active(cluster.b), migrations()
    assert cluster.b.proc is not None
    os.kill(cluster.b.proc.pid, signal.SIGKILL)
    # its stubs outlive it, reparented (and can spin, sharing the 2 CPUs with the migration under
    # test); serve's supervisor kills a dead server's process group when it notices: so do we
    os.killpg(cluster.b.proc.pid, signal.SIGKILL)
    return on_b, before


def both_up(cluster: Cluster) -> None:
    """Server B started again if a test killed it (the next test that needs it starts it: not
    the module's end), then both decode instances routed to."""
    if cluster.b.proc is None or cluster.b.proc.poll() is not None:
        cluster.b.restart(timeout_s=400)
    wait_all_up(cluster)


def test_triton_api_streams_move_off_a_killed_server(cluster, tokenizer, hf_model):
    both_up(cluster)
    prompts = PROMPTS[:6]
    streams = ConcurrentStreams(cluster.a.grpc_url, prompts, SERVER_KILL_TOKENS, ignore_eos=True)
    try:
        on_b, before = kill_server_b_under(cluster, streams.received, lambda: front_migrations(cluster.a))
        results = streams.join()
        assert [r.error for r in results] == [None] * len(prompts)
        for prompt, r in zip(prompts, results):
            want = hf_greedy(hf_model, prompt_token_ids(tokenizer, prompt, False), SERVER_KILL_TOKENS)
            assert r.token_ids == want, prompt
        assert on_b >= 1
        moved = wait_metric(cluster.a.metrics_url, "triton_disagg_migrations_total", before + on_b, model="llm")
        moved -= before
        print(f"{on_b:.0f} of {len(prompts)} streams were on server B when it was killed; {moved:.0f} moved")
    finally:
        streams.join()


def test_openai_streams_move_off_a_killed_server(cluster, tokenizer, hf_model):
    both_up(cluster)
    prompts = PROMPTS[:6]
    streams = OpenAIStreams(cluster.client(), prompts, SERVER_KILL_TOKENS)
    received, texts, errors, threads = streams.received, streams.texts, streams.errors, streams.threads
    [t.start() for t in threads]
    try:
        on_b, before = kill_server_b_under(cluster, received, cluster.migrations)
        [t.join(300) for t in threads]
        assert errors == [None] * len(prompts)
        for prompt, text in zip(prompts, texts):
            want = hf_greedy(hf_model, prompt_token_ids(tokenizer, prompt, False), SERVER_KILL_TOKENS)
            assert text == tokenizer.decode(want, skip_special_tokens=True), prompt
        moved = cluster.migrations() - before
        print(f"{on_b:.0f} of {len(prompts)} streams were on server B when it was killed; {moved:.0f} moved")
        assert moved >= on_b >= 1
    finally:
        [t.join(300) for t in threads]
