"""A deployment that changes while it serves, on real parts: a real etcd, real tritonservers
(one in another network namespace when the machine allows it), real NIXL, the real model.

- A decode server started on another "host" with only ``discovery`` joins a running deployment
  under load and serves within 10 s of being ready; one of its decode instances is drained under
  load (``triton-disagg drain``, a 2 s window: the requests it ends then move to the server's other
  decode instance) and no request fails; the server then stops under load, leaving the
  membership first, and no request fails.
- etcd killed for 30 s under load: no request fails; a decode server started during the outage
  joins once etcd is back.
- A record written with a wrong signature never reaches routing.
"""

from __future__ import annotations

import threading
import time

import pytest

from backend.client import stream_generate
from backend.disagg.auth import SECRET_ENV, new_secret
from tests.conftest import EXACT, etcd_server, fabric_env, metric_values, running_server, wait_pool_free

pytestmark = pytest.mark.usefixtures("nixl")

COMMON = {
    **EXACT,
    "kv_cache_tokens": "4096",
    "max_num_batched_tokens": "128",
    "num_threads": "1",
    "kv_transfer_timeout_s": "20",
    "kv_quarantine_s": "3",
    "local_prefill_max_tokens": "0",  # every prefill crosses the fabric
    "membership_ttl_s": "3",
    "membership_grace_s": "6",
}


class Load:
    """Requests sent back to back from ``threads`` threads to one server until stopped."""

    def __init__(self, url: str, threads: int = 2, tokens: int = 24, tag: str = ""):
        self.results: list = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, tokens, f"{tag}{i}")) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, url: str, tokens: int, tag: str) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            prompt = f"Request {tag}-{k}: tell me something about the number {k}."
            self.results.append(stream_generate(url, prompt, tokens, ignore_eos=True, timeout_s=120))

    def stop(self) -> list:
        self._stop.set()
        for t in self._threads:
            t.join(180)
        return self.results


def errors(results: list) -> list:
    return [r.error for r in results if r.error is not None]


@pytest.fixture(scope="module")
def deployment(two_hosts, model_dir, tmp_path_factory):
    """etcd and server A (prefill_0, decode_0, front) on the root namespace's address."""
    from backend.launch.deployment import render_deployment

    ip_ns, ns, dev_ns, ip_root, dev_root = two_hosts
    tmp = tmp_path_factory.mktemp("membership")
    etcd = etcd_server(tmp, host=ip_root)
    repo = render_deployment(
        tmp / "a",
        mode="disagg",
        model_path=str(model_dir),
        overrides=COMMON,
        messenger_host=ip_root,
        discovery=etcd.url,
    )
    secret = {SECRET_ENV: new_secret()}
    env = fabric_env(secret, dev_root)
    with etcd, running_server(repo, tmp / "a.log", extra_env=env) as server:
        yield {"etcd": etcd, "a": server, "tmp": tmp, "secret": secret, "hosts": two_hosts, "model_dir": model_dir}


def decode_server(d: dict, name: str, decode_instances: int, on_other_host: bool, per_model: dict | None = None):
    """A server with only decode instances (and its front), joining through etcd."""
    from backend.launch.deployment import render_deployment

    ip_ns, ns, dev_ns, ip_root, dev_root = d["hosts"]
    repo = render_deployment(
        d["tmp"] / name,
        mode="decode",
        model_path=str(d["model_dir"]),
        overrides=COMMON,
        decode_instances=decode_instances,
        per_model=per_model,
        discovery=d["etcd"].url,
    )
    env = fabric_env(d["secret"], dev_ns if on_other_host else dev_root)
    host = {"host": ip_ns, "netns": ns} if on_other_host and ns else {}
    return running_server(repo, d["tmp"] / f"{name}.log", extra_env=env, **host)


def first_success_s(url: str, timeout_s: float = 60) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if stream_generate(url, "What is the capital of France?", 4, timeout_s=30).error is None:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"no request succeeded within {timeout_s}s")


def test_a_decode_server_joins_under_load_drains_and_stops_without_failing_a_request(deployment):
    from backend.launch.drain import drain, find, members

    a = deployment["a"]
    load_a = Load(a.grpc_url, tag="a")
    try:
        # decode_1's drain window is 2 s: the requests it has then outlast it, so it ends them
        # and B's front moves them to its decode_0 (their error responses cross a BLS call)
        drain_window = {"decode_1": {"drain_timeout_s": "2"}}
        with decode_server(deployment, "b", decode_instances=2, on_other_host=True, per_model=drain_window) as b:
            joined = first_success_s(b.grpc_url)
            print(f"server B (other host) served its first request {joined:.1f}s after it was ready")
            assert joined <= 10
            load_b = Load(b.grpc_url, threads=3, tokens=48, tag="b")
            try:
                time.sleep(3)
                secret = deployment["secret"][SECRET_ENV].encode()
                records = members(deployment["etcd"].url, "default", secret)
                victim = next(
                    r for r in records if r.role == "decode" and r.grpc_url == b.grpc_url and r.model == "decode_1"
                )
                drain(deployment["etcd"].url, find(records, victim.name), secret)
                deadline = time.monotonic() + 60
                while any(r.name == victim.name for r in members(deployment["etcd"].url, "default", secret)):
                    assert time.monotonic() < deadline, "the drained instance never left the membership"
                    time.sleep(0.5)
                # B's front now sends everything to its decode_0
                after = stream_generate(b.grpc_url, "Still serving after the drain?", 4, ignore_eos=True)
                assert after.error is None, after.error
                # SIGTERM-like stop under load: leave the membership, finish what is in flight (within
                # serve's default drain window, 30 s: a 48-token request on 2 loaded cores can take 10 s)
                stopper = threading.Thread(target=b.stop, kwargs={"drain_timeout_s": 30.0})
                stopper.start()
                time.sleep(1.0)
            finally:
                results_b = load_b.stop()
            stopper.join(120)
    finally:
        results_a = load_a.stop()
    assert errors(results_a) == []
    # requests sent to B after its stop began are refused (its front drains): the ones it took finished
    took = [r for r in results_b if r.error is None or "shutting down" not in r.error]
    assert errors(took) == [], errors(took)
    assert len(results_b) >= 3
    wait_pool_free(a.metrics_url, "prefill_0")
    wait_pool_free(a.metrics_url, "decode_0")


def test_etcd_outage_under_load(deployment):
    a, etcd = deployment["a"], deployment["etcd"]
    load = Load(a.grpc_url, tag="outage")
    try:
        time.sleep(2)
        etcd.kill()
        t_kill = time.monotonic()
        c_box: dict = {}

        def start_c():  # a decode server started during the outage (same host)
            cm = decode_server(deployment, "c", decode_instances=1, on_other_host=False)
            c_box["server"] = cm.__enter__()
            c_box["cm"] = cm

        starter = threading.Thread(target=start_c)
        starter.start()
        time.sleep(max(0.0, 30 - (time.monotonic() - t_kill)))
        assert etcd.running() is False
        before_restart = len(load.results)
        etcd.start()
        starter.join(400)
        c = c_box["server"]
        try:
            joined = first_success_s(c.grpc_url, timeout_s=60)
            print(f"server C (started during the outage) served {joined:.1f}s after etcd came back and it was ready")
        finally:
            c_box["cm"].__exit__(None, None, None)
    finally:
        results = load.stop()
        if not etcd.running():
            etcd.start()  # the next test needs it
    assert before_restart > 5 and errors(results) == [], errors(results)
    for m in ("prefill_0", "decode_0"):
        wait_pool_free(a.metrics_url, m)
    up = metric_values(a.metrics_url, "triton_disagg_prefill_endpoints_connected", model="decode_0")
    assert up and up[0] >= 1


def test_a_forged_record_never_reaches_routing(deployment, caplog):
    from backend.cluster.etcd import EtcdClient
    from backend.cluster.records import InstanceRecord, encode, key_of

    a, etcd = deployment["a"], deployment["etcd"]
    forged = InstanceRecord("default", "forged-prefill", "prefill", "", "", "127.0.0.1:9", "x", "y", 1, time.time())
    EtcdClient(etcd.url).put(key_of(forged), encode(forged, b"not-the-deployment-secret-0123456789"))
    time.sleep(2)
    log = (deployment["tmp"] / "a.log").read_text()
    assert "forged-prefill" in log and "wrong signature" in log, "the decode instance should log the forged record"
    r = stream_generate(a.grpc_url, "Still serving?", 6, ignore_eos=True)
    assert r.error is None
    assert metric_values(a.metrics_url, "triton_disagg_prefill_endpoints_connected", model="decode_0") == [1.0]
