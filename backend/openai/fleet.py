"""The decode instances of a deployment as the frontend reaches them over the network (with
``--discovery``): their signed records from etcd (a ``Membership(role="decode")``,
``backend/cluster/``: a record that fails verification is logged and never routed to; a record
says whether its instance drains, why it cannot serve, and its cache summary), one gRPC client
per Triton server, a readiness probe of each instance (Triton's own ``ModelReady``) every
``health_probe_interval_s`` of the router's settings (every 0.1 s while one has never passed a
probe), all feeding a :class:`Router`, which picks and migrates.

The membership's threads hand their changes to the event loop, where the router lives.
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
from backend.cluster.membership import Membership, Registration
from backend.cluster.records import InstanceRecord, routable
from backend.cluster.tracing import NO_SPAN, Span
from backend.openai.router import Router, Target
from backend.openai.triton_stream import Delta, GenerationError, GenerationParams, StreamLost, TritonStream

log = logging.getLogger("triton_disagg.openai")


class DecodeFleet:
    """``start()`` / ``close()`` on the event loop; ``generate()`` one request (routed and, when
    its instance fails it, moved by ``router``)."""

    def __init__(self, discovery: str, deployment: str, secret: bytes, router: Router):
        self.discovery, self.deployment = discovery, deployment
        self.router = router
        self._secret = secret
        self._clients: dict[str, TritonStream] = {}
        self._probing: dict[str, asyncio.Task] = {}
        self._membership: Membership | None = None
        self._registration: Registration | None = None
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def changed(joined: list[InstanceRecord], left: list[InstanceRecord]) -> None:  # membership threads
            with contextlib.suppress(RuntimeError):  # the loop closed: shutting down
                loop.call_soon_threadsafe(self._changed, joined, left)

        self._membership = Membership(
            EtcdClient(self.discovery), self.deployment, self._secret, role="decode", accept=routable, on_change=changed
        )
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
        self._loop_task = asyncio.create_task(self._probe_loop())
        log.info("routing across the decode instances of deployment %r in %s", self.deployment, self.discovery)

    def _changed(self, joined: list[InstanceRecord], left: list[InstanceRecord]) -> None:
        self.router.update(joined, left)
        self._probe_all()  # a member that joined is probed now, not a second later

    async def _probe_loop(self) -> None:
        while True:
            self._probe_all()
            await asyncio.sleep(self.router.table.probe_interval())

    def _probe_all(self) -> None:
        for target in self.router.targets():
            if target.name not in self._probing:
                self._probing[target.name] = asyncio.create_task(self._probe(target))

    async def _probe(self, target: Target) -> None:
        error, unanswered = None, False
        try:
            await self._client(target.grpc_url).model_ready(target.model, self.router.settings.health_probe_timeout_s)
        except GenerationError as e:
            error, unanswered = e.message, isinstance(e, StreamLost)
        finally:
            self._probing.pop(target.name, None)
        self.router.probed(target.name, error, unanswered)

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
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in list(self._probing.values()):
            task.cancel()
        if self._registration is not None:
            await asyncio.to_thread(self._registration.close)
        if self._membership is not None:
            await asyncio.to_thread(self._membership.close)
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
