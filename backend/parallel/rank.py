"""The worker ranks (1..t-1) of a tensor-parallel instance: started, watched and stopped by the
lead (:class:`RankProcesses`), and what each runs (``python -m backend.parallel.rank``).

A worker reads its set-up message from stdin (engine config, rank, rendezvous port, its KV
shard handle), maps its shard pool, joins the instance's process group, loads and shards the
model, then runs every step message it reads: the same forward as the lead over its own
heads. It exits at a "stop" message, at end of stdin (the lead is gone) or on any error (a
broken collective). The lead's watcher reports a worker that exits while the instance runs.
"""

from __future__ import annotations

import logging
import sys

from backend.engine.config import EngineConfig
from backend.parallel.comm import join_group, read_step_message
from backend.parallel.rank_runner import GROUP_TIMEOUT_S, TPModelRunner, rank_device
from backend.parallel.shm_pools import open_shard


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s tp-rank %(levelname)s %(message)s")
    stdin = sys.stdin.buffer
    init = read_step_message(stdin)
    if init is None:
        return 0
    rank, world = init["rank"], init["world"]
    device = rank_device(EngineConfig(**init["config"]), rank)
    config = EngineConfig(**{**init["config"], "device": str(device)})
    shard = open_shard(init["shard"])
    group = join_group(None, init["port"], rank, world, device, init["prefix"], GROUP_TIMEOUT_S)
    runner = TPModelRunner(config, rank, world, group, shard, None)
    while True:
        msg = read_step_message(stdin)
        if msg is None or msg[0] == "stop":
            return 0
        _, entries, kwargs = msg
        runner.run(entries, **kwargs)


if __name__ == "__main__":
    raise SystemExit(main())
