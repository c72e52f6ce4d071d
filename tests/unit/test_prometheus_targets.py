"""The Prometheus that ``serve --prometheus`` starts (``backend/launch/prometheus_server.py``),
without the process: its targets file follows the membership (one target per server, labelled
with its roles and members; static ones added; a record that leaves takes its server out once no
other record names it) and is replaced whole; its configuration names the rules and the file.
The real Prometheus against a real deployment: ``tests/integration/test_prometheus.py``."""

from __future__ import annotations

import json

from backend.cluster.records import InstanceRecord
from backend.launch.prometheus_server import RULES, PrometheusServer


def record(name: str, role: str, metrics_url: str) -> InstanceRecord:
    return InstanceRecord("default", name, role, "h:1", "m", "", "id", "kv", 1, 0.0, metrics_url=metrics_url)


def test_the_targets_follow_the_membership(tmp_path):
    p = PrometheusServer(folder=tmp_path, static=["http://10.0.0.9:9000/metrics"])
    a, b = "http://10.0.0.1:8002/metrics", "http://10.0.0.2:8002/metrics"
    p._changed([record("d0", "decode", a), record("p0", "prefill", a), record("d1", "decode", b)], [])
    groups = json.loads(p.targets_file.read_text())
    by_target = {g["targets"][0]: g["labels"] for g in groups}
    assert by_target["10.0.0.1:8002"] == {"__metrics_path__": "/metrics", "roles": "decode,prefill", "members": "d0,p0"}
    assert by_target["10.0.0.2:8002"]["members"] == "d1" and by_target["10.0.0.9:9000"]["roles"] == "static"
    p._changed([], [record("d1", "decode", b), record("p0", "prefill", a)])
    by_target = {g["targets"][0]: g["labels"] for g in json.loads(p.targets_file.read_text())}
    assert set(by_target) == {"10.0.0.1:8002", "10.0.0.9:9000"} and by_target["10.0.0.1:8002"]["members"] == "d0"
    assert not list(tmp_path.glob("*.tmp"))  # written under another name, then renamed


def test_the_configuration_names_the_rules_and_the_targets_file(tmp_path):
    config = json.loads(PrometheusServer(folder=tmp_path, interval_s=2).config())
    assert config["rule_files"] == [str(RULES)] and RULES.exists()
    assert config["global"] == {"scrape_interval": "2s", "evaluation_interval": "2s"}
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == [str(tmp_path / "targets.json")]
