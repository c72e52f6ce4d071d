"""The one launcher (``backend/launch/launcher.py``) that ``serve``, the test fixtures and the
benchmarks call: what it refuses before anything starts, and the core placement it renders
(``backend/launch/deployment.py``: split between the roles for ``serve`` and the benchmarks,
under any parameter the caller sets). Starting real servers through it: every server test (the
fixtures), ``tests/integration/test_cli.py`` (``serve``) and the benchmarks' tests."""

from __future__ import annotations

import pytest

from backend.disagg.auth import SECRET_ENV
from backend.launch.deployment import core_split, render_deployment
from backend.launch.launcher import Launch, LaunchError
from build_scripts.render_repository import read_parameters


def params(repo, model: str) -> dict:
    return read_parameters((repo / model / "config.pbtxt").read_text())


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        (Launch(mode="decode", discovery="etcd://h:1"), "must share the deployment secret"),
        (Launch(mode="prefill", extra_env={SECRET_ENV: "x" * 32}), "give --discovery etcd://HOST:PORT"),
        (Launch(mode="prefill", secret_file="s", discovery="etcd://h:1", openai_port=0), "prefill-only server"),
    ],
)
def test_a_launch_that_cannot_start_is_refused_before_anything_starts(launch, message, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(LaunchError, match=message):
        launch.start()


def test_serve_and_the_benchmarks_split_the_cores_between_the_roles(tmp_path):
    assert Launch().placement == "split"
    pre, dec, n_pre, n_dec = core_split()
    repo = render_deployment(tmp_path / "split", mode="disagg", model_path="/m", decode_instances=2, placement="split")
    assert params(repo, "prefill_0")["cpu_affinity"] == pre and params(repo, "prefill_0")["num_threads"] == str(n_pre)
    for d in ("decode_0", "decode_1"):
        assert params(repo, d)["cpu_affinity"] == dec and params(repo, d)["num_threads"] == str(n_dec)
    # what the caller sets wins over the placement
    repo = render_deployment(
        tmp_path / "mine",
        mode="disagg",
        model_path="/m",
        placement="split",
        overrides={"num_threads": "3"},
        per_model={"decode": {"cpu_affinity": "0"}},
    )
    assert params(repo, "prefill_0")["num_threads"] == "3" and params(repo, "decode_0")["cpu_affinity"] == "0"
    # shared (the fixtures'; a prefill- or decode-only server): nothing pinned, one thread each
    repo = render_deployment(tmp_path / "shared", mode="disagg", model_path="/m")
    assert params(repo, "decode_0")["cpu_affinity"] == "" and params(repo, "decode_0")["num_threads"] == "1"
    with pytest.raises(ValueError, match="placement 'spread' is not one of"):
        render_deployment(tmp_path / "bad", mode="disagg", model_path="/m", placement="spread")
