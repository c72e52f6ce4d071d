"""Prefill and decode in different Triton servers on different "hosts": two network
namespaces' worth of separation made by the test (the root namespace and a new one, joined
by a veth pair), KV over NIXL/UCX TCP on the veth, the client talking only to the decode side.
The decode side finds the prefill instance in the deployment's membership (a real etcd on the
decode host's address; nothing lists the prefill instance's address by hand)."""

from __future__ import annotations

import threading

import pytest

from backend.client import stream_generate
from backend.disagg.auth import SECRET_ENV, new_secret
from tests.conftest import (
    EXACT,
    PROMPTS,
    etcd_server,
    fabric_env,
    hf_greedy,
    running_server,
    wait_metric,
    wait_pool_free,
)


@pytest.fixture(scope="module")
def split_servers(two_hosts, model_dir, tmp_path_factory):
    from backend.launch.deployment import render_deployment

    ip_ns, ns, dev_ns, ip_root, dev_root = two_hosts
    tmp = tmp_path_factory.mktemp("xhost")
    common = {
        "kv_cache_tokens": "2048",
        "max_num_batched_tokens": "64",
        "num_threads": "1",
        "kv_transfer_timeout_s": "20",
        "local_prefill_max_tokens": "0",  # every prefill crosses the namespaces
        **EXACT,
    }
    etcd = etcd_server(tmp, host=ip_root)
    prefill_repo = render_deployment(
        tmp / "prefill",
        mode="prefill",
        model_path=str(model_dir),
        overrides=common,
        messenger_host=ip_ns,
        discovery=etcd.url,
    )
    decode_repo = render_deployment(
        tmp / "decode",
        mode="decode",
        model_path=str(model_dir),
        overrides=common,
        decode_instances=2,
        discovery=etcd.url,
    )
    secret = {SECRET_ENV: new_secret()}  # two servers: one deployment secret
    env_p, env_d = fabric_env(secret, dev_ns), fabric_env(secret, dev_root)
    with (
        etcd,
        running_server(prefill_repo, tmp / "prefill.log", host=ip_ns, netns=ns, extra_env=env_p) as prefill,
        running_server(decode_repo, tmp / "decode.log", extra_env=env_d) as decode,
    ):
        yield prefill, decode


def test_cross_host_one_prefill_two_decode(split_servers, hf_model, tokenizer):
    prefill, decode = split_servers
    prompts = [PROMPTS[0], PROMPTS[6], PROMPTS[7], PROMPTS[2]]
    results = [None] * len(prompts)
    # Triton is ready before each decode instance has connected to the prefill instance across
    # the namespaces: requests sent before both serve all go to the first that does
    for m in ("decode_0", "decode_1"):
        wait_metric(decode.metrics_url, "triton_disagg_decode_target_up", 1, timeout_s=60, target=m)

    def run(i):
        results[i] = stream_generate(decode.grpc_url, prompts[i], 8, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    for prompt, res in zip(prompts, results):
        assert res.error is None, res.error
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert res.token_ids == hf_greedy(hf_model, ids, 8)
    for m in ("decode_0", "decode_1"):  # the front spread the requests over both decode instances
        wait_metric(decode.metrics_url, "triton_disagg_requests_total", 1, model=m)
    chat = stream_generate(decode.grpc_url, "What is the capital of France?", 24, chat=True)
    assert "Paris" in chat.text
    log = prefill.log_file.read_text()
    assert "sent:" in log and "writes" in log, "the prefill server should have streamed the KV"
    wait_pool_free(prefill.metrics_url, "prefill_0")
    wait_pool_free(decode.metrics_url, "decode_0")
    wait_pool_free(decode.metrics_url, "decode_1")
