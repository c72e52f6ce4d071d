"""Triton Python-backend model for a prefill (context) instance.

The instance hosts a :class:`PrefillWorker` (engine + KV sender + messenger server) in its own
process. Its work arrives from decode instances over the messenger, not through Triton
inference requests; ``execute`` answers any direct request with a clear error.
``triton-disagg drain`` reaches it apart from its inputs, through its drain key in etcd
(``backend/serving/drain.py``). When its server stops it drains too: it leaves the membership
first.
"""

from __future__ import annotations

import logging
from functools import partial

from backend.disagg import auth
from backend.engine.outputs import ErrorKind
from backend.serving.config import InstanceConfig
from backend.serving.drain import watch_drain_requests
from backend.serving.prefill_worker import PrefillWorker
from backend.serving.worker import Drain, Instance
from backend.triton.lifecycle import DrainWatch, request_reload
from backend.triton.metrics import InstanceMetrics
from backend.triton.model_args import init_model
from backend.triton.sender import triton_error

log = logging.getLogger("triton_disagg.model")


class TritonPythonModel:
    def initialize(self, args):
        pb_utils, cfg, params, self.instance = init_model(args)
        self.pb = pb_utils
        config = InstanceConfig.from_parameters(params)
        if config.role != "prefill":
            raise ValueError(f"the prefill model needs role 'prefill', got {config.role!r}")
        self.worker: Instance = PrefillWorker(config, self.instance, cfg["name"])
        # a tensor-parallel instance that lost a rank: the server's supervisor loads it again
        self.worker.on_out_of_service(partial(request_reload, args["model_repository"], cfg["name"]))
        self.metrics = InstanceMetrics(pb_utils, {"model": cfg["name"], "instance": self.instance}, self.worker.stats)
        secret = auth.load_secret(config.membership.deployment_secret_file)
        drain = Drain(self.worker, f"prefill {self.instance}", config.serving.drain_timeout_s)
        self.drain = DrainWatch(args["model_repository"], drain.start)
        self.drain_requests = watch_drain_requests(config, self.worker.member_name(), secret, drain.start)
        log.info("instance %s ready: %s", self.instance, self.worker.describe())

    def execute(self, requests):
        pb = self.pb
        for request in requests:
            request.get_response_sender().send(
                pb.InferenceResponse(
                    error=triton_error(
                        pb,
                        ErrorKind.BAD_REQUEST,
                        "the prefill model is fed by decode instances over the KV "
                        "messenger; send client requests to the front model",
                    )
                ),
                flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        return None

    def finalize(self):
        log.info("instance %s shutting down", self.instance)
        self.drain.close()
        if self.drain_requests is not None:
            self.drain_requests.close()
        self.worker.shutdown()
        self.metrics.close()
