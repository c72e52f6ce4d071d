"""``triton-disagg``: prepare the model, serve it on a real Triton server, and query it.

triton-disagg prepare [--model PATH]
triton-disagg serve [--mode aggregated|disagg] [--host H] [--http-port P] ...   (Ctrl-C stops)
triton-disagg demo                 serve, answer a sample prompt through Triton, stop
triton-disagg generate "prompt"    stream an answer from a running server
triton-disagg openai --triton-url HOST:PORT   the OpenAI-compatible API in front of a running deployment
triton-disagg drain INSTANCE --discovery etcd://HOST:PORT   take one instance out without failing a request
triton-disagg plan [--profile FILE] [--cores N | --nodes N]   recommend a deployment for an SLO
triton-disagg agent --discovery etcd://HOST:PORT   start and stop this host's instances for the autoscaler
triton-disagg autoscale --discovery etcd://HOST:PORT --ttft S --itl S   scale prefill and decode to an SLO
triton-disagg bench SUBCOMMAND     the benchmarks (perf/), each run recorded with its commit and machine
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from backend.disagg.auth import add_secret_flag, parse_args

log = logging.getLogger("triton_disagg.cli")
SAMPLE_PROMPT = "What is the capital of France?"


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=["aggregated", "disagg", "prefill", "decode"],
        default="aggregated",
        help="disagg: prefill + decode + front in this server; prefill/decode: one side of a "
        "deployment split across servers or hosts",
    )
    p.add_argument("--model", default=None, help="HF checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="bind address for HTTP, gRPC and metrics")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--prefill-instances", type=int, default=1)
    p.add_argument("--decode-instances", type=int, default=1)
    p.add_argument(
        "--messenger-host", default="127.0.0.1", help="prefill side: address decode instances reach its KV messenger on"
    )
    p.add_argument(
        "--discovery",
        default=None,
        metavar="etcd://HOST:PORT",
        help="join the deployment whose membership is in this etcd (needed by --mode prefill/decode; "
        "--mode disagg without it starts a private etcd)",
    )
    p.add_argument("--deployment", default="default", help="the deployment's name in etcd")
    p.add_argument(
        "--etcd-host",
        default=None,
        help="--mode disagg: address the private etcd listens on (default: --messenger-host), for instances "
        "on other hosts that join with --discovery",
    )
    p.add_argument("--with-aggregated", action="store_true", help="also serve llm_aggregated for comparison")
    p.add_argument(
        "--kv-store",
        default="",
        metavar="redis://HOST:PORT|none",
        help="the shared KV tier's store, for a deployment across machines (default: --mode disagg starts a "
        "private Redis on this machine when redis-server is installed; none: no shared tier)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default="",
        metavar="http://HOST:PORT",
        help="export OpenTelemetry trace spans of every request (front, decode, prefill, KV transfer) to this "
        "collector over OTLP/HTTP; a client's traceparent header joins them to its trace (default: no tracing)",
    )
    p.add_argument(
        "--prometheus",
        type=int,
        default=None,
        metavar="PORT",
        help="also start a Prometheus on this port (0: a free one) that scrapes every server of the deployment "
        "(following its membership) with the recording and alert rules of deploy/prometheus/",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model parameter for every model (e.g. kv_cache_tokens=32768)",
    )
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"override a parameter of the {role} models only (e.g. num_threads=1, cpu_affinity=0)",
        )
    p.add_argument(
        "--router-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a router setting of the Triton front model and the OpenAI frontend alike (migration_limit, "
        "health_probe_interval_s, health_probe_timeout_s, health_probe_failures, kv_routing_weight)",
    )
    add_secret_flag(
        p,
        "file holding the deployment secret (signs membership records and drain requests, KV messenger "
        "peers prove it; split deployments: the same file on every server; default: $TRITON_DISAGG_DEPLOYMENT_SECRET, "
        "else a secret generated for this run)",
    )
    p.add_argument(
        "--fabric-device",
        default=None,
        help="network device(s) the KV fabric (NIXL/UCX) may use, e.g. eth0 (UCX_NET_DEVICES); default: "
        "loopback when the messenger addresses are loopback, else UCX's choice",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on Ctrl-C/SIGTERM: seconds the requests in flight may take to finish before they end",
    )
    p.add_argument("--log-file", default=None)
    p.add_argument(
        "--openai-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions) on this port",
    )


def _overrides(items: list[str]) -> dict:
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"--set expects KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def start_server(args):
    """Start what ``serve`` / ``demo`` asked for, through the one launcher (``backend/launch/launcher.py``)."""
    from backend.launch.launcher import Launch, LaunchError
    from backend.serving.config import RouterSettings
    from build_scripts.prepare_model import ensure_model

    overrides = _overrides(args.set)
    if args.fabric_device:
        overrides["fabric_device"] = args.fabric_device
    per_model = {role: _overrides(getattr(args, f"{role}_set")) for role in ("prefill", "decode")}
    if any(per_model.values()) and args.mode == "aggregated":
        raise SystemExit("--prefill-set/--decode-set: an aggregated deployment has no prefill or decode models")
    router = _overrides(args.router_set)
    try:  # checked here, named, before any server starts
        RouterSettings.from_parameters(router)
    except ValueError as e:
        raise SystemExit(f"--router-set: {e}") from None
    if router and args.mode not in ("disagg", "decode"):
        raise SystemExit(f"--router-set: nothing routes in {args.mode} mode (it has no front model)")
    launch = Launch(
        mode=args.mode,
        overrides=overrides,
        per_model={k: v for k, v in per_model.items() if v},
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        with_aggregated=args.with_aggregated,
        discovery=args.discovery or "",
        deployment=args.deployment,
        secret_file=args.deployment_secret_file or "",
        messenger_host=args.messenger_host,
        etcd_host=args.etcd_host or "",
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        log_file=args.log_file,
        router=router,
        openai_port=args.openai_port,
        openai_log_file=Path(args.log_file).with_suffix(".openai.log") if args.log_file else None,
        kv_store=args.kv_store,
        otlp_endpoint=args.otlp_endpoint,
        prometheus_port=args.prometheus,
        timeout_s=300.0,
    )
    try:
        launch.check()
    except LaunchError as e:
        raise SystemExit(str(e)) from None
    launch.model_dir = ensure_model(args.model)
    log.info("serving %s in %s mode", launch.model_dir, args.mode)
    try:
        server, frontend = launch.start()
    except LaunchError as e:
        raise SystemExit(str(e)) from None
    if args.mode != "aggregated":
        secret = f" --deployment-secret-file {launch.used_secret_file}" if launch.used_secret_file else ""
        print(
            f"membership: {launch.used_discovery} (deployment {args.deployment!r}); other servers join with "
            f"--discovery {launch.used_discovery} --deployment {args.deployment}{secret}",
            flush=True,
        )
    if server.prometheus is not None:
        print(
            f"prometheus: {server.prometheus.url} (scrapes the deployment's servers; {server.prometheus.config_file})",
            flush=True,
        )
    return server, frontend


def stop_server(server, frontend, drain_timeout_s: float = 5.0) -> None:
    from backend.launch.launcher import stop

    stop(server, frontend, drain_timeout_s)


def cmd_prepare(args) -> int:
    from build_scripts.prepare_model import ensure_model

    print(ensure_model(args.model))
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from backend.launch.restarts import RestartPolicy

    policy = RestartPolicy()
    p.add_argument(
        "--max-restarts",
        type=int,
        default=policy.max_restarts,
        help=f"restart tritonserver when it exits unasked, at most this many times within {policy.window_s:g} s; "
        "past it (0: at the first exit) stop everything and exit non-zero",
    )


def take_sigint() -> None:
    """Ctrl-C (SIGINT) stops a long-running command (raises ``KeyboardInterrupt``) even where it
    started with SIGINT ignored: a shell starts a background job (``cmd &``, nohup) so, Python
    leaves it ignored, and so would the processes the command starts."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def cmd_serve(args) -> int:
    from backend.launch.restarts import RestartPolicy, ServerWatch

    try:  # checked before anything starts
        policy = RestartPolicy(max_restarts=args.max_restarts)
    except ValueError as e:
        raise SystemExit(f"--max-restarts: {e}") from None
    take_sigint()
    server, frontend = start_server(args)
    openai = f", OpenAI API {frontend.url}/v1" if frontend is not None else ""
    print(
        f"Triton is serving ({args.mode}) on {args.host}: HTTP {server.http_port}, gRPC {server.grpc_port}, "
        f"metrics {server.metrics_port}{openai}. Try:\n  triton-disagg generate --url {server.grpc_url} "
        f'--chat "{SAMPLE_PROMPT}"\nCtrl-C stops.',
        flush=True,
    )
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(now=True))
    down = ""  # why tritonserver stays down
    try:
        down = ServerWatch(server, policy).run(lambda: stop["now"])
    except KeyboardInterrupt:
        pass
    finally:
        if down:
            print(f"error: {down}; stopping everything serve started", file=sys.stderr, flush=True)
        else:
            print(
                "stopping tritonserver: draining (leaving the membership, finishing requests in flight; "
                "interrupt again to stop at once) ...",
                flush=True,
            )
        try:
            stop_server(server, frontend, args.drain_timeout)
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            print("stopping now: the requests in flight end", flush=True)
            stop_server(server, frontend, 0.0)
    return 1 if down else 0


def cmd_demo(args) -> int:
    from backend.client import stream_generate

    if args.log_file is None:
        args.log_file = str(Path(tempfile.mkdtemp(prefix="triton-disagg-")) / "tritonserver.log")
        print(f"tritonserver log: {args.log_file}", flush=True)
    server, frontend = start_server(args)
    try:
        print(f"> {SAMPLE_PROMPT}", flush=True)
        res = stream_generate(
            server.grpc_url, SAMPLE_PROMPT, 48, chat=True, on_text=lambda t: print(t, end="", flush=True)
        )
        print(flush=True)
        if res.error:
            print(f"error: {res.error}", file=sys.stderr)
            return 1
        print(f"[{len(res.token_ids)} tokens, time to first token {res.ttft:.3f}s, finish reason {res.finish_reason}]")
    finally:
        stop_server(server, frontend)
    return 0


def cmd_generate(args) -> int:
    from backend.client import stream_generate

    res = stream_generate(
        args.url,
        args.prompt,
        args.max_tokens,
        model=args.model_name,
        chat=args.chat,
        temperature=args.temperature,
        seed=args.seed,
        stream=not args.no_stream,
        on_text=lambda t: print(t, end="", flush=True),
    )
    print(flush=True)
    if res.error:
        print(f"error: {res.error}", file=sys.stderr)
        return 1
    return 0


def cmd_drain(args) -> int:
    from backend.disagg.auth import AuthError, load_secret
    from backend.launch.drain import drain, find, members

    try:
        secret = load_secret(args.deployment_secret_file)
        record = find(members(args.discovery, args.deployment, secret), args.instance)
        drain(args.discovery, record, secret)
    except (LookupError, RuntimeError, ConnectionError, AuthError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"draining {record.role} instance {record.name} ({record.model} at {record.grpc_url}): it takes no new "
        "requests, lets those in flight finish (drain_timeout_s), moves the rest and leaves the membership"
    )
    return 0


def cmd_agent(args) -> int:
    from backend.autoscale.agent import AgentConfig, run
    from backend.disagg.auth import AuthError, load_secret

    if not args.deployment_secret_file:
        raise SystemExit(
            "agent: give --deployment-secret-file FILE, the deployment secret (the same file on every host)"
        )
    try:
        load_secret(args.deployment_secret_file)
    except AuthError as e:
        raise SystemExit(f"agent: {e}") from None
    role_sets = {r: getattr(args, f"{r}_set") for r in ("prefill", "decode")}
    config = AgentConfig(
        discovery=args.discovery,
        secret_file=str(Path(args.deployment_secret_file).resolve()),
        deployment=args.deployment,
        host=args.host,
        messenger_host=args.messenger_host or args.host,
        port=args.port,
        max_instances=args.max_instances,
        drain_timeout_s=args.drain_timeout,
        model=args.model or "",
        sets=args.set,
        role_sets=role_sets,
        log_dir=args.log_dir or "",
    )
    take_sigint()
    return run(config)


def cmd_autoscale(args) -> int:
    from backend.autoscale.actuator import Actuator, LocalAgents
    from backend.autoscale.autoscaler import Autoscaler, serve_metrics
    from backend.autoscale.model import PerformanceModel
    from backend.autoscale.policy import Policy, PolicyConfig
    from backend.cluster.etcd import EtcdClient
    from backend.cluster.membership import Membership
    from backend.disagg.auth import AuthError, load_secret
    from backend.engine.step_profile import EngineProfile
    from backend.planner.slo import SLO

    try:
        secret = load_secret(args.deployment_secret_file)
        policy = PolicyConfig(
            SLO(args.ttft, args.itl),
            min_instances={"prefill": args.min_prefill, "decode": args.min_decode},
            max_instances={"prefill": args.max_prefill, "decode": args.max_decode},
            scale_in_intervals=args.scale_in_intervals,
            cooldown_s=args.cooldown,
            up_cooldown_s=args.up_cooldown,
        )
        model = None
        if args.profile:
            model = PerformanceModel(EngineProfile.load(Path(args.profile)), policy.slo, threads=args.instance_threads)
    except (AuthError, ValueError, KeyError, OSError) as e:
        raise SystemExit(f"autoscale: {e}") from None
    membership = Membership(EtcdClient(args.discovery), args.deployment, secret)
    actuator: Actuator
    if args.actuator == "kubernetes":
        from backend.autoscale.actuator import ActuatorError
        from backend.autoscale.kubernetes import KubernetesActuator

        try:
            actuator = KubernetesActuator.from_args(
                args.k8s_namespace, args.k8s_deployments, grpc_port=args.k8s_grpc_port
            )
        except (ActuatorError, ValueError) as e:
            membership.close()
            raise SystemExit(f"autoscale: {e}") from None
    else:
        actuator = LocalAgents(lambda: membership.members("agent"), secret)
    scaler = Autoscaler(
        membership,
        actuator,
        Policy(policy),
        model,
        interval_s=args.interval,
        start_timeout_s=args.start_timeout,
        decisions_file=args.decisions_file,
    )
    if args.metrics_port:
        serve_metrics(scaler, args.host, args.metrics_port)
    print(
        f"autoscaling deployment {args.deployment!r} in {args.discovery} to TTFT p90 <= {args.ttft} s, ITL p90 <= "
        f"{args.itl} s; prefill {args.min_prefill}..{args.max_prefill}, decode {args.min_decode}..{args.max_decode}; "
        f"actuator {actuator.name}"
        + (f"; metrics http://{args.host}:{args.metrics_port}/metrics" if args.metrics_port else ""),
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *a: scaler.stop())
    take_sigint()
    try:
        scaler.run()
    except KeyboardInterrupt:
        pass
    membership.close()
    print("autoscale: stopped; the deployment stays as it is", flush=True)
    return 0


def _add_autoscale_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--discovery", required=True, metavar="etcd://HOST:PORT", help="the deployment's etcd")
    sp.add_argument("--deployment", default="default")
    add_secret_flag(sp, "the deployment secret (default: $TRITON_DISAGG_DEPLOYMENT_SECRET)")
    sp.add_argument("--ttft", type=float, required=True, help="SLO: TTFT p90 in seconds")
    sp.add_argument("--itl", type=float, required=True, help="SLO: inter-token latency p90 in seconds")
    for role in ("prefill", "decode"):
        sp.add_argument(f"--min-{role}", type=int, default=1, help=f"never fewer {role} instances")
        sp.add_argument(f"--max-{role}", type=int, default=2, help=f"never more {role} instances")
    sp.add_argument("--interval", type=float, default=10.0, help="seconds between decisions")
    sp.add_argument("--cooldown", type=float, default=60.0, help="seconds after a change before any scale-in")
    sp.add_argument(
        "--up-cooldown", type=float, default=30.0, help="seconds after a change of a role before it grows again"
    )
    sp.add_argument(
        "--scale-in-intervals", type=int, default=3, help="comfortable intervals in a row before a scale-in"
    )
    sp.add_argument("--start-timeout", type=float, default=240.0, help="seconds a new instance has to join")
    sp.add_argument(
        "--profile", default=None, help="engine profile (triton-disagg plan's): predict with the planner's model"
    )
    sp.add_argument("--instance-threads", type=int, default=1, help="threads per instance, for the model")
    sp.add_argument("--actuator", choices=["agents", "kubernetes"], default="agents")
    sp.add_argument("--k8s-namespace", default="default")
    sp.add_argument(
        "--k8s-deployments",
        default="prefill=triton-disagg-prefill,decode=triton-disagg-decode",
        help="role=Deployment name, for --actuator kubernetes",
    )
    sp.add_argument("--k8s-grpc-port", type=int, default=8001)
    sp.add_argument("--host", default="127.0.0.1", help="address of the autoscaler's /metrics")
    sp.add_argument("--metrics-port", type=int, default=0, help="serve /metrics and /status here (0: off)")
    sp.add_argument("--decisions-file", default=None, help="append one JSON line per interval here")


def _add_agent_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--discovery", required=True, metavar="etcd://HOST:PORT", help="the deployment's etcd")
    sp.add_argument("--deployment", default="default")
    add_secret_flag(sp, "the deployment secret (needed; the same file on every host)")
    sp.add_argument("--host", default="127.0.0.1", help="address its instances and control API listen on")
    sp.add_argument(
        "--messenger-host", default=None, help="address of its prefill instances' messengers (default: --host)"
    )
    sp.add_argument("--port", type=int, default=0, help="control API port (0: a free one)")
    sp.add_argument("--max-instances", type=int, default=4, help="most instances this host runs at once")
    sp.add_argument("--drain-timeout", type=float, default=30.0, help="an instance's drain window when it is stopped")
    sp.add_argument("--model", default=None)
    sp.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="model parameter for every instance"
    )
    for role in ("prefill", "decode"):
        sp.add_argument(
            f"--{role}-set", action="append", default=[], metavar="KEY=VALUE", help=f"{role} instances only"
        )
    sp.add_argument("--log-dir", default=None, help="where its instances' logs go")


def cmd_bench(args) -> int:
    # the benchmarks live in perf/, above everything here (nothing in backend imports it): they run
    # as a program of their own, ``python -m perf.cli``, with this process's environment
    import subprocess

    return subprocess.call([sys.executable, "-m", "perf.cli", *args.bench_args])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def cmd_plan(args) -> int:
    from backend.engine.step_profile import EngineProfile
    from backend.planner.planner import evaluate, machine_candidates, node_candidates, table
    from backend.planner.slo import SLO
    from backend.planner.workload import load_trace, poisson, scaled

    profile_path = Path(args.profile)
    if profile_path.is_file():
        profile = EngineProfile.load(profile_path)
        print(f"profile: {profile_path} ({profile.model}, {profile.weights_dtype}, threads {sorted(profile.threads)})")
    else:
        from backend.planner.profiler import profile_engine
        from build_scripts.prepare_model import ensure_model

        threads = (
            _ints(args.profile_threads)
            if args.profile_threads
            else sorted({1, args.node_threads} if args.nodes else set(range(1, args.cores + 1)))
        )
        print(f"profiling the engine ({args.weights_dtype}, threads {threads}) into {profile_path} ...", flush=True)
        profile = profile_engine(str(ensure_model(args.model)), threads, args.weights_dtype)
        profile.save(profile_path)
    for k, v in profile.summary().items():
        print(f"  {k}: {v}")
    if args.speedup != 1.0:
        profile = profile.scaled(args.speedup)
        print(f"  every step time divided by --speedup {args.speedup:g}")
    budgets = _ints(args.budgets)
    if args.nodes:
        candidates = node_candidates(args.nodes, args.node_threads, budgets, args.kv_cache_tokens, args.max_num_seqs)
    else:
        candidates = machine_candidates(
            args.cores, budgets, sorted(profile.threads), args.kv_cache_tokens, args.max_num_seqs
        )
    if not candidates:
        raise SystemExit(f"no candidate deployment: the profile has threads {sorted(profile.threads)}")
    if args.trace:
        base = load_trace(Path(args.trace))

        def trace_at(rate: float):
            return scaled(base, rate)

        start = len(base) / max(base[-1].arrival_s, 1e-9)
    else:

        def trace_at(rate: float):
            return poisson(rate, args.requests, tuple(args.prompt_tokens), tuple(args.output_tokens), args.seed)

        start = 0.1
    slo = SLO(args.ttft_slo, args.itl_slo)
    print(
        f"SLO: TTFT <= {slo.ttft_s:g} s and ITL p90 <= {slo.itl_p90_s * 1e3:g} ms for >= 90% of requests; "
        f"{len(candidates)} candidates",
        flush=True,
    )
    results = evaluate(candidates, profile, slo, trace_at, start)
    print(table(results))
    best = results[0]
    if best.goodput <= 0:
        print("no candidate meets the SLO at any rate: loosen it or add capacity")
        return 1
    print(f"\nrecommended: {best.candidate.deployment.name}, goodput {best.goodput:.3f} req/s (simulated)")
    print(best.candidate.serve_command)
    return 0


def _add_plan_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--profile",
        default="triton-disagg-profile.json",
        help="engine profile (JSON); measured on the real engine and saved there if the file is missing",
    )
    sp.add_argument("--model", default=None, help="checkpoint to profile (default: SmolLM2-135M-Instruct)")
    sp.add_argument("--weights-dtype", default="auto", help="weights format to profile (auto: serve's default)")
    sp.add_argument("--profile-threads", default="", help="thread counts to profile, e.g. 1,2")
    where = sp.add_mutually_exclusive_group()
    where.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="one machine of N cores")
    where.add_argument("--nodes", type=int, default=0, help="N separate nodes of --node-threads threads each")
    sp.add_argument("--node-threads", type=int, default=2)
    sp.add_argument(
        "--speedup", type=float, default=1.0, help="the target hardware is this many times faster than the profiled"
    )
    sp.add_argument("--budgets", default="64,128,256,512", help="per-step token budgets to consider")
    sp.add_argument("--kv-cache-tokens", type=int, default=16384)
    sp.add_argument("--max-num-seqs", type=int, default=32)
    sp.add_argument("--ttft-slo", type=float, required=True, help="seconds")
    sp.add_argument("--itl-slo", type=float, required=True, help="seconds, bound on each request's p90 inter-token gap")
    sp.add_argument(
        "--trace", default=None, help="JSON-lines trace (arrival_s, prompt_tokens, output_tokens), rescaled per rate"
    )
    sp.add_argument("--prompt-tokens", type=int, nargs=2, default=(256, 512))
    sp.add_argument("--output-tokens", type=int, nargs=2, default=(32, 64))
    sp.add_argument("--requests", type=int, default=300, help="simulated Poisson requests per rate")
    sp.add_argument("--seed", type=int, default=0)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after it is the benchmark's (argparse's REMAINDER drops a leading --help)
        return cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    p = argparse.ArgumentParser(
        prog="triton-disagg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("prepare", help="convert the packaged GGUF model into a checkpoint dir")
    sp.add_argument("--model", default=None)
    sp.set_defaults(fn=cmd_prepare)
    for name, fn, help_ in (
        ("serve", cmd_serve, "run tritonserver until Ctrl-C, restarting it when it dies"),
        ("demo", cmd_demo, "serve, answer a sample prompt, stop"),
    ):
        sp = sub.add_parser(name, help=help_)
        _add_server_args(sp)
        sp.set_defaults(fn=fn)
    _add_serve_args(sub.choices["serve"])
    sp = sub.add_parser("generate", help="stream an answer from a running server")
    sp.add_argument("prompt")
    sp.add_argument("--url", default="127.0.0.1:8001", help="gRPC address")
    sp.add_argument("--model-name", default="llm")
    sp.add_argument("--max-tokens", type=int, default=64)
    sp.add_argument("--temperature", type=float, default=None)
    sp.add_argument("--seed", type=int, default=None)
    sp.add_argument("--chat", action="store_true", help="apply the model's chat template on the server")
    sp.add_argument("--no-stream", action="store_true")
    sp.set_defaults(fn=cmd_generate)
    sp = sub.add_parser("openai", help="serve the OpenAI-compatible API in front of a running deployment")
    from backend.openai.__main__ import add_args, run

    add_args(sp)
    sp.set_defaults(fn=run)
    sp = sub.add_parser("drain", help="take one instance of a deployment out without failing a request")
    sp.add_argument("instance", help="its name in the membership, or its Triton model name (e.g. decode_1)")
    sp.add_argument("--discovery", required=True, metavar="etcd://HOST:PORT", help="the deployment's etcd")
    sp.add_argument("--deployment", default="default")
    add_secret_flag(sp, "the deployment secret (default: $TRITON_DISAGG_DEPLOYMENT_SECRET)")
    sp.set_defaults(fn=cmd_drain)
    sp = sub.add_parser("plan", help="recommend a deployment for an SLO from an engine profile and a simulation")
    _add_plan_args(sp)
    sp.set_defaults(fn=cmd_plan)
    sp = sub.add_parser("agent", help="start and stop this host's instances for the autoscaler")
    _add_agent_args(sp)
    sp.set_defaults(fn=cmd_agent)
    sp = sub.add_parser("bench", help="run a benchmark (triton-disagg bench --help lists them)", add_help=False)
    sp.add_argument("bench_args", nargs=argparse.REMAINDER)
    sp.set_defaults(fn=cmd_bench)
    sp = sub.add_parser("autoscale", help="scale prefill and decode instances to an SLO as the load changes")
    _add_autoscale_args(sp)
    sp.set_defaults(fn=cmd_autoscale)
    args = parse_args(p, argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
