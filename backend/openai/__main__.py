"""The OpenAI-compatible frontend as a server process: ``python -m backend.openai --triton-url
HOST:PORT --port N`` (also ``triton-disagg openai``, and ``triton-disagg serve --openai-port N``
next to Triton)."""

from __future__ import annotations

import argparse
import logging


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--triton-url", default="127.0.0.1:8001", help="gRPC address of the Triton deployment")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--triton-model", default="llm", help="the Triton model to call (the front or aggregated model)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: --triton-model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for chat templates (default: the packaged model)")
    p.add_argument("--max-tokens-default", type=int, default=1024, help="output limit of a chat request without one")


def run(args) -> int:
    import uvicorn

    from backend.openai.app import FrontendConfig, build_app

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
    )
    logging.getLogger("triton_disagg.openai").info(
        "OpenAI API on http://%s:%d/v1 -> Triton %s model %s", args.host, args.port, args.triton_url, args.triton_model
    )
    uvicorn.run(build_app(config), host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    return 0


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    p = argparse.ArgumentParser(prog="python -m backend.openai", description=__doc__)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
