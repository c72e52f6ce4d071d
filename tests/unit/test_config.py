"""The configuration tree (parsed once, defaults in one place, unknown keys refused) and the
rendering of config.pbtxt files from templates and the one tensor definition."""

from __future__ import annotations

import pytest

from backend.launch.deployment import render_deployment
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
    assert 'name: "health_probe", data_type: TYPE_BOOL' in decode
    assert 'name: "instance_state", data_type: TYPE_STRING' in decode and "instance_state" not in llm


def test_render_refuses_unknown_parameter(tmp_path):
    with pytest.raises(ValueError, match=r"model 'llm': unknown parameter\(s\) \['page_sise'\]"):
        render_deployment(tmp_path / "repo", mode="aggregated", model_path="/m", overrides={"page_sise": "32"})
    with pytest.raises(ValueError, match="parameter 'page_size' must be an integer"):
        render_deployment(tmp_path / "repo", mode="aggregated", model_path="/m", overrides={"page_size": "big"})


def test_fabric_device_binds_loopback_deployments_to_lo(monkeypatch):
    from backend.disagg.config import ConnectorConfig

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert ConnectorConfig(messenger_host="127.0.0.1").net_devices() == "lo"
    assert ConnectorConfig(prefill_endpoints="127.0.0.1:5000,localhost:5001").net_devices() == "lo"
    assert ConnectorConfig(prefill_endpoints="127.0.0.1:5000,10.0.0.2:5001").net_devices() is None
    assert ConnectorConfig(messenger_host="0.0.0.0").net_devices() is None
    assert ConnectorConfig(messenger_host="10.0.0.2", fabric_device="eth1").net_devices() == "eth1"
    assert ConnectorConfig(fabric_device="all").net_devices() is None
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")  # the operator's choice stands under auto
    assert ConnectorConfig(messenger_host="127.0.0.1").net_devices() is None
