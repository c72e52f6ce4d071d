"""The configuration tree (parsed once, defaults in one place, unknown keys refused), the
membership section and the deployment secret's names (old ones accepted for a release), and the
rendering of config.pbtxt files from templates and the one tensor definition."""

from __future__ import annotations

import argparse
import logging

import pytest

from backend.cluster.config import MembershipConfig
from backend.disagg import auth
from backend.disagg.config import ConnectorConfig
from backend.launch.deployment import render_deployment
from backend.openai.__main__ import add_args
from backend.serving.config import FrontConfig, InstanceConfig, ServingConfig, parameter_defaults
from backend.serving.tensors import INPUTS, OUTPUTS
from build_scripts.render_repository import read_parameters


def test_instance_config_sections():
    c = InstanceConfig.from_parameters(
        {
            "role": "decode",
            "model_path": "/m",
            "page_size": "32",
            "max_waiting_for_pages": "3",
            "prefill_endpoints": "h:1,g:2",
            "stream_layers": "false",
            "kv_transfer_timeout_s": "2.5",
        }
    )
    assert (c.role, c.engine.page_size, c.serving.max_waiting_for_pages) == ("decode", 32, 3)
    assert c.connector.endpoints() == [("h", 1), ("g", 2)] and c.connector.stream_layers is False
    assert c.connector.kv_transfer_timeout_s == 2.5
    assert c.engine.max_tokens_limit == 1024  # the one default (was 1024 in one place, 4096 in another)


CONFLICT = "messenger_secret_file and deployment_secret_file are both given, with different values"


@pytest.mark.parametrize(
    "params, message",
    [
        ({"model_path": "/m", "bogus": "1"}, r"unknown parameter\(s\) \['bogus'\]"),
        ({"model_path": "/m", "role": "mixer"}, "parameter 'role' must be one of"),
        ({"model_path": ""}, "parameter 'model_path' is empty"),
        ({"model_path": "/m", "meta_slots": "many"}, "parameter 'meta_slots' must be an integer"),
        ({"model_path": "/m", "stream_layers": "maybe"}, "parameter 'stream_layers' must be true or false"),
        ({"model_path": "/m", "kv_quarantine_s": "nan"}, "must be a finite number"),
        ({"model_path": "/m", "speculative_k": "99"}, "speculative_k must be in"),
        ({"model_path": "/m", "cpu_affinity": "x"}, "cpu_affinity"),
        ({"model_path": "/m", "prefill_endpoints": "nohost"}, "must be host:port"),
        ({"model_path": "/m", "membership_ttl_s": "0.5"}, "membership_ttl_s must be >= 1"),
        ({"model_path": "/m", "membership_grace_s": "0"}, "membership_grace_s must be > 0"),
        ({"model_path": "/m", "state_interval_s": "0"}, "state_interval_s must be > 0"),
        ({"model_path": "/m", "discovery": "etcd:2379"}, "discovery 'etcd:2379' must be etcd://HOST:PORT"),
        ({"model_path": "/m", "deployment": "a/b"}, "deployment 'a/b' must be a non-empty name"),
        ({"model_path": "/m", "messenger_secret_file": "/a", "deployment_secret_file": "/b"}, CONFLICT),
    ],
)
def test_instance_config_refuses(params, message):
    with pytest.raises(ValueError, match=message):
        InstanceConfig.from_parameters(params)


def test_cpu_affinity_ranges():
    assert ServingConfig(cpu_affinity="0,2-3").cores() == {0, 2, 3}


def test_front_config():
    assert FrontConfig.from_parameters({"decode_models": "decode_0, decode_1"}).targets() == ["decode_0", "decode_1"]
    with pytest.raises(ValueError, match="lists no decode model"):
        FrontConfig.from_parameters({"decode_models": " , "})
    with pytest.raises(ValueError, match="kv_routing_weight"):
        FrontConfig.from_parameters({"kv_routing_weight": "-1"})
    # no fixed list: the deployment's membership (every server), its settings parsed as the instances' are
    spanning = FrontConfig.from_parameters({"discovery": "etcd://h:2379", "deployment": "d", "membership_grace_s": "3"})
    assert spanning.targets() == [] and spanning.membership.deployment == "d"
    assert spanning.membership.membership_grace_s == 3.0
    with pytest.raises(ValueError, match="discovery 'h:1' must be etcd://HOST:PORT"):
        FrontConfig.from_parameters({"discovery": "h:1"})
    with pytest.raises(ValueError, match="parameter 'membership' names a section"):
        FrontConfig.from_parameters({"decode_models": "d", "membership": "x"})
    with pytest.raises(ValueError, match=r"unknown front model parameter\(s\) \['discovry'\]"):
        FrontConfig.from_parameters({"discovry": "etcd://h:1"})


def test_a_front_with_a_membership_is_rendered_without_a_fixed_list(tmp_path):
    repo = render_deployment(tmp_path / "repo", mode="disagg", model_path="/m", discovery="etcd://127.0.0.1:2379")
    params = read_parameters((repo / "llm" / "config.pbtxt").read_text())
    assert params["decode_models"] == "" and params["discovery"] == "etcd://127.0.0.1:2379"
    assert FrontConfig.from_parameters(params).membership.discovery == "etcd://127.0.0.1:2379"
    # a decode-only server's front routes to its own decode models
    repo = render_deployment(tmp_path / "dec", mode="decode", model_path="/m", discovery="etcd://127.0.0.1:2379")
    assert read_parameters((repo / "llm" / "config.pbtxt").read_text())["decode_models"] == "decode_0"


def test_rendered_repository_lists_tensors_and_every_parameter(tmp_path):
    repo = render_deployment(tmp_path / "repo", mode="disagg", model_path="/m", overrides={"page_size": "32"})
    llm = (repo / "llm" / "config.pbtxt").read_text()  # the front model
    decode = (repo / "decode_0" / "config.pbtxt").read_text()
    prefill = (repo / "prefill_0" / "config.pbtxt").read_text()
    for spec in INPUTS:
        assert f'name: "{spec.name}", data_type: {spec.data_type}' in llm
        assert f'name: "{spec.name}", data_type: {spec.data_type}' in decode
    for spec in OUTPUTS:
        assert f'name: "{spec.name}"' in llm and f'name: "{spec.name}"' in decode
    assert 'name: "cancel_request_id"' in decode and "{{" not in decode + prefill + llm
    params = read_parameters(decode)
    assert set(params) == set(parameter_defaults("decode"))
    assert params["page_size"] == "32" and params["role"] == "decode" and params["prefill_endpoints"]
    assert read_parameters(prefill)["role"] == "prefill"
    assert read_parameters(llm) == {**parameter_defaults("front"), "decode_models": "decode_0", "model_path": "/m"}
    # health and cache summaries travel in the membership record, not through the decode model
    assert "health_probe" not in decode and "instance_state" not in decode


def test_render_refuses_unknown_parameter(tmp_path):
    with pytest.raises(ValueError, match=r"model 'llm': unknown parameter\(s\) \['page_sise'\]"):
        render_deployment(tmp_path / "repo", mode="aggregated", model_path="/m", overrides={"page_sise": "32"})
    with pytest.raises(ValueError, match="parameter 'page_size' must be an integer"):
        render_deployment(tmp_path / "repo", mode="aggregated", model_path="/m", overrides={"page_size": "big"})


def test_fabric_device_binds_loopback_deployments_to_lo(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert ConnectorConfig(messenger_host="127.0.0.1").net_devices() == "lo"
    assert ConnectorConfig(prefill_endpoints="127.0.0.1:5000,localhost:5001").net_devices() == "lo"
    assert ConnectorConfig(prefill_endpoints="127.0.0.1:5000,10.0.0.2:5001").net_devices() is None
    assert ConnectorConfig(messenger_host="0.0.0.0").net_devices() is None
    assert ConnectorConfig(messenger_host="10.0.0.2", fabric_device="eth1").net_devices() == "eth1"
    assert ConnectorConfig(fabric_device="all").net_devices() is None
    # with the membership in etcd the peers are not known yet: loopback if the etcd is
    assert ConnectorConfig(messenger_host="127.0.0.1").net_devices(etcd_host="localhost") == "lo"
    assert ConnectorConfig(messenger_host="127.0.0.1").net_devices(etcd_host="10.0.0.3") is None
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")  # the operator's choice stands under auto
    assert ConnectorConfig(messenger_host="127.0.0.1").net_devices() is None


def test_membership_settings_are_their_own_section():
    c = InstanceConfig.from_parameters(
        {
            "role": "decode",
            "model_path": "/m",
            "discovery": "etcd://10.0.0.3:2379",
            "deployment": "blue",
            "membership_ttl_s": "3",
            "membership_grace_s": "6",
            "deployment_secret_file": "/etc/deploy.secret",
            "state_interval_s": "0.25",
        }
    )
    assert c.membership == MembershipConfig("etcd://10.0.0.3:2379", "blue", 3.0, 6.0, "/etc/deploy.secret", 0.25)
    assert c.membership.etcd_host() == "10.0.0.3" and MembershipConfig().etcd_host() == ""
    assert not {"discovery", "deployment_secret_file"} & set(ConnectorConfig.__dataclass_fields__)


@pytest.fixture
def deprecations(monkeypatch, caplog):
    """The deprecation lines logged from here on (as if this process had logged none yet)."""
    monkeypatch.setattr(auth, "_warned", set())
    caplog.set_level(logging.WARNING, logger="triton_disagg.auth")
    return lambda: [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


def test_old_parameter_name_is_accepted_with_one_deprecation_line(deprecations):
    for _ in range(2):
        c = InstanceConfig.from_parameters({"model_path": "/m", "messenger_secret_file": "/s"})
        assert c.membership.deployment_secret_file == "/s"
    same = {"model_path": "/m", "messenger_secret_file": "/s", "deployment_secret_file": "/s"}
    assert InstanceConfig.from_parameters(same).membership.deployment_secret_file == "/s"
    assert deprecations() == ["messenger_secret_file is deprecated and will be removed: use deployment_secret_file"]


def test_old_environment_variable_is_accepted_with_a_deprecation_line(deprecations, monkeypatch):
    secret = auth.new_secret()
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.setenv("TRITON_DISAGG_MESSENGER_SECRET", secret)
    assert auth.load_secret() == secret.encode()
    assert deprecations() == [
        "TRITON_DISAGG_MESSENGER_SECRET is deprecated and will be removed: use TRITON_DISAGG_DEPLOYMENT_SECRET"
    ]
    monkeypatch.setenv(auth.SECRET_ENV, auth.new_secret())
    with pytest.raises(auth.AuthError, match="TRITON_DISAGG_MESSENGER_SECRET and TRITON_DISAGG_DEPLOYMENT_SECRET"):
        auth.load_secret()


def test_old_flag_is_accepted_with_a_deprecation_line(deprecations, capsys):
    p = argparse.ArgumentParser()
    add_args(p)  # the OpenAI frontend's flags; every command adds the secret's with add_secret_flag
    args = auth.parse_args(p, ["--messenger-secret-file", "old.secret"])
    assert args.deployment_secret_file == "old.secret" and not hasattr(args, "messenger_secret_file")
    assert auth.parse_args(p, ["--deployment-secret-file", "new.secret"]).deployment_secret_file == "new.secret"
    assert deprecations() == ["--messenger-secret-file is deprecated and will be removed: use --deployment-secret-file"]
    with pytest.raises(SystemExit):
        auth.parse_args(p, ["--messenger-secret-file", "a", "--deployment-secret-file", "b"])
    assert "--messenger-secret-file and --deployment-secret-file are both given" in capsys.readouterr().err


def test_rendering_writes_the_new_names_and_keeps_the_membership_settings(tmp_path, deprecations):
    repo = render_deployment(
        tmp_path / "repo",
        mode="decode",
        model_path="/m",
        overrides={"messenger_secret_file": "/s", "membership_ttl_s": "3"},
        discovery="etcd://127.0.0.1:2379",
        deployment="blue",
    )
    params = read_parameters((repo / "decode_0" / "config.pbtxt").read_text())
    assert "messenger_secret_file" not in params
    membership = InstanceConfig.from_parameters(params).membership
    assert membership == MembershipConfig("etcd://127.0.0.1:2379", "blue", 3.0, 10.0, "/s")
    assert len(deprecations()) == 1
