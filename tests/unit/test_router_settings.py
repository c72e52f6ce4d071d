"""The router settings are defined once (``RouterSettings``) and the same for both routers: the
Triton front model's parameters and the OpenAI frontend's flags have the same names, defaults and
checks; ``serve --router-set`` sets them for both and is refused, naming the setting, before any
server starts."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from backend import cli
from backend.openai.__main__ import add_args
from backend.openai.__main__ import run as run_frontend
from backend.openai.app import FrontendConfig
from backend.openai.router import Router
from backend.serving.config import ROUTER_SETTINGS, FrontConfig, RouterSettings


def test_both_routers_start_from_the_same_settings():
    assert ROUTER_SETTINGS == (
        "health_probe_interval_s",
        "health_probe_timeout_s",
        "health_probe_failures",
        "kv_routing_weight",
        "migration_limit",
    )
    front = FrontConfig(decode_models="decode_0")
    assert {n: getattr(front, n) for n in ROUTER_SETTINGS} == dataclasses.asdict(RouterSettings())
    assert FrontendConfig("unused:1").router == RouterSettings()
    assert Router().table.settings == RouterSettings()
    both = RouterSettings(migration_limit=0, health_probe_failures=5)
    assert Router(both).table.settings is both  # one routing core reads them (backend/serving/routing.py)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("migration_limit", "-1", "migration_limit must be >= 0"),
        ("health_probe_failures", "0", "health_probe_failures must be > 0"),
        ("health_probe_interval_s", "0", "health_probe_interval_s must be > 0"),
        ("kv_routing_weight", "-0.5", "kv_routing_weight must be >= 0"),
        ("migration_limt", "1", "unknown router parameter"),
    ],
)
def test_a_bad_setting_is_refused_by_name_by_both(name, value, message):
    with pytest.raises(ValueError, match=message):
        RouterSettings.from_parameters({name: value})
    if name in ROUTER_SETTINGS:
        with pytest.raises(ValueError, match=message):
            FrontConfig.from_parameters({name: value})
        p = argparse.ArgumentParser()
        add_args(p)
        args = p.parse_args([f"--{name.replace('_', '-')}", value])
        with pytest.raises(SystemExit, match=f"router settings: {message}"):
            run_frontend(args)


def test_the_frontend_flags_are_the_settings():
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--migration-limit", "1", "--health-probe-interval-s", "0.5", "--kv-routing-weight", "0"])
    settings = RouterSettings.from_parameters({n: getattr(args, n) for n in ROUTER_SETTINGS})
    assert settings == RouterSettings(migration_limit=1, health_probe_interval_s=0.5, kv_routing_weight=0.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "disagg", "--router-set", "migration_limit=-2"], "--router-set: migration_limit must be >= 0"),
        (["--mode", "disagg", "--router-set", "probe=1"], "--router-set: unknown router parameter"),
        (["--router-set", "migration_limit=1"], "--router-set: nothing routes in aggregated mode"),
    ],
)
def test_serve_refuses_a_bad_router_setting_before_starting(argv, message):
    p = argparse.ArgumentParser()
    cli._add_server_args(p)
    with pytest.raises(SystemExit, match=message):
        cli.start_server(p.parse_args(argv))
