"""The OpenAI-compatible frontend as a server process: ``python -m backend.openai --triton-url
HOST:PORT --port N`` (also ``triton-disagg openai``, and ``triton-disagg serve --openai-port N``
next to Triton). With ``--discovery etcd://HOST:PORT`` it routes across the decode instances of
the deployment's membership (on any number of Triton servers) and moves a request whose instance
fails it to another (at most ``--migration-limit`` times; the router settings, flags here, are
the Triton front model's: ``RouterSettings``); the membership records are verified with the
deployment secret (``--deployment-secret-file``, else the environment variable
``TRITON_DISAGG_DEPLOYMENT_SECRET``)."""

from __future__ import annotations

import argparse
import logging


def add_args(p: argparse.ArgumentParser) -> None:
    from backend.disagg.auth import add_secret_flag
    from backend.serving.config import ROUTER_SETTINGS, RouterSettings

    p.add_argument("--triton-url", default="127.0.0.1:8001", help="gRPC address of the Triton deployment")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--triton-model", default="llm", help="the Triton model to call (the front or aggregated model)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: --triton-model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for chat templates (default: the packaged model)")
    p.add_argument("--max-tokens-default", type=int, default=1024, help="output limit of a chat request without one")
    p.add_argument(
        "--discovery",
        default="",
        metavar="etcd://HOST:PORT",
        help="route across the decode instances registered in this etcd (instead of one Triton model)",
    )
    p.add_argument("--deployment", default="default", help="the deployment's name in etcd (with --discovery)")
    p.add_argument(
        "--otlp-endpoint",
        default="",
        metavar="http://HOST:PORT",
        help="export each request's trace spans to this OpenTelemetry collector (OTLP/HTTP); a client's "
        "traceparent header joins them to its trace, and the deployment's own spans join them (default: off)",
    )
    add_secret_flag(
        p, "the deployment secret that signs membership records (default: $TRITON_DISAGG_DEPLOYMENT_SECRET)"
    )
    for name in ROUTER_SETTINGS:  # the Triton front model's router settings, same names and defaults
        p.add_argument(
            "--" + name.replace("_", "-"),
            default=None,
            metavar="VALUE",
            help=f"router setting {name} (with --discovery; default {getattr(RouterSettings(), name)}: "
            "see backend/serving/config.py RouterSettings)",
        )


def run(args) -> int:
    import uvicorn

    from backend.openai.app import FrontendConfig, build_app
    from backend.serving.config import ROUTER_SETTINGS, RouterSettings

    log = logging.getLogger("triton_disagg.openai")
    secret = b""
    if args.discovery:
        from backend.cluster.etcd import base_url
        from backend.disagg.auth import AuthError, load_secret

        try:
            base_url(args.discovery)
            secret = load_secret(args.deployment_secret_file)
        except (ValueError, AuthError) as e:
            raise SystemExit(f"--discovery: {e}") from None
    try:
        router = RouterSettings.from_parameters({n: getattr(args, n) for n in ROUTER_SETTINGS})
    except ValueError as e:
        raise SystemExit(f"router settings: {e}") from None
    tokenizer = args.tokenizer
    if tokenizer is None:
        from build_scripts.prepare_model import ensure_model

        tokenizer = str(ensure_model(None))
    config = FrontendConfig(
        triton_url=args.triton_url,
        triton_model=args.triton_model,
        served_model_name=args.served_model_name or args.triton_model,
        tokenizer=tokenizer,
        max_tokens_default=args.max_tokens_default,
        discovery=args.discovery,
        deployment=args.deployment,
        secret=secret,
        router=router,
        otlp_endpoint=args.otlp_endpoint,
        instance=f"openai-{args.host}:{args.port}",
    )
    if args.discovery:
        log.info(
            "OpenAI API on http://%s:%d/v1 -> the decode instances of deployment %r in %s (%s)",
            args.host,
            args.port,
            args.deployment,
            args.discovery,
            router,
        )
    else:
        log.info(
            "OpenAI API on http://%s:%d/v1 -> Triton %s model %s",
            args.host,
            args.port,
            args.triton_url,
            args.triton_model,
        )
    uvicorn.run(build_app(config), host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    return 0


def main(argv=None) -> int:
    from backend.disagg.auth import parse_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    p = argparse.ArgumentParser(prog="python -m backend.openai", description=__doc__)
    add_args(p)
    return run(parse_args(p, argv))


if __name__ == "__main__":
    raise SystemExit(main())
