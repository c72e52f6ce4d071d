"""The decode instances of a deployment as the frontend reaches them over the network (with
``--discovery``): the shared membership watcher and readiness probes (``Router.watch``,
``backend/serving/target_watch.py``: signed records from etcd, a readiness probe of each
instance every ``health_probe_interval_s`` of the router's settings) feeding the :class:`Router`,
which picks and migrates; one gRPC streaming client per Triton server; and this frontend's own
membership record (role ``router``).

The watcher's threads hand what they learn to the event loop, where the router lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator

from backend.cluster.etcd import EtcdClient
from backend.cluster.membership import Registration
from backend.cluster.records import InstanceRecord
from backend.cluster.tracing import NO_SPAN, Span
from backend.openai.router import Router, Target
from backend.openai.triton_stream import Delta, GenerationParams, TritonStream

log = logging.getLogger("triton_disagg.openai")


class DecodeFleet:
    """``start()`` / ``close()`` on the event loop; ``generate()`` one request (routed and, when
    its instance fails it, moved by ``router``)."""

    def __init__(self, discovery: str, deployment: str, secret: bytes, router: Router):
        self.discovery, self.deployment = discovery, deployment
        self.router = router
        self._secret = secret
        self._clients: dict[str, TritonStream] = {}
        self._registration: Registration | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def on_loop(fn, *args) -> None:  # the watcher's threads
            with contextlib.suppress(RuntimeError):  # the loop closed: shutting down
                loop.call_soon_threadsafe(fn, *args)

        self.router.watch.post = on_loop
        self.router.watch.follow(self.discovery, self.deployment, self._secret)
        # routers are members too (role "router"): what an operator or an autoscaler can list
        record = InstanceRecord(
            deployment=self.deployment,
            name=f"{socket.gethostname()}-openai-{os.getpid()}",
            role="router",
            grpc_url="",
            model="openai",
            messenger="",
            model_identity="",
            kv_layout="",
            tp_size=1,
            started_at=time.time(),
        )
        self._registration = Registration(EtcdClient(self.discovery), record, self._secret).start()
        self.router.watch.start_probing()
        log.info("routing across the decode instances of deployment %r in %s", self.deployment, self.discovery)

    def _client(self, url: str) -> TritonStream:
        if url not in self._clients:
            self._clients[url] = TritonStream(url)
        return self._clients[url]

    def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: GenerationParams,
        token_ids: list[int],
        span: Span = NO_SPAN,
    ) -> AsyncGenerator[Delta, None]:
        """The request's deltas; ``prompt``: text or token ids; ``token_ids``: its prompt
        tokenized as the decode models do. An attempt that resumes after output tokens is not
        asked for the prompt's log-probabilities: they came with the first response. ``span``:
        the request's (each attempt is a child span, its context sent with the call)."""
        resumed = dataclasses.replace(params, prompt_log_probs=False)

        def open_stream(target: Target, resume: list[int], traceparent: str) -> AsyncIterator[Delta]:
            return self._client(target.grpc_url).generate(
                target.model, prompt, resumed if resume else params, resume, traceparent
            )

        return self.router.generate(request_id, token_ids, params.max_tokens, open_stream, params.cache_salt, span)

    async def close(self) -> None:
        await asyncio.to_thread(self.router.watch.close)
        if self._registration is not None:
            await asyncio.to_thread(self._registration.close)
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
