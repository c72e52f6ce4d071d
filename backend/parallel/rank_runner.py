"""One rank's model runner in a tensor-parallel instance: the model with this rank's shards
(``backend/parallel/shards.py``), attending over this rank's KV shard pool. Rank 0 (the lead)
and every worker rank run it."""

from __future__ import annotations

import torch

from backend.engine.config import EngineConfig
from backend.engine.kv_pool import KVPool
from backend.engine.model_runner import ModelRunner
from backend.parallel.comm import all_reduce
from backend.parallel.shards import LayerSignal, check_shardable, shard_model

GROUP_TIMEOUT_S = 120.0


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    return torch.device("cuda", rank) if config.torch_device.type == "cuda" else torch.device("cpu")


class TPModelRunner(ModelRunner):
    """One rank's runner: the model with this rank's shards, attending over its shard pool."""

    lean_layers = False  # the shards replace the layers' projections after loading

    def __init__(
        self, config: EngineConfig, rank: int, world: int, group, shard: torch.Tensor, signal: LayerSignal | None
    ):
        self.tp_rank, self.tp_size, self._shard = rank, world, shard
        super().__init__(config)
        shard_model(self.model, rank, world, group, signal)
        all_reduce(group, torch.zeros(1))  # barrier: every rank has its shards loaded

    def _make_pool(self, config: EngineConfig, head_dim: int) -> KVPool:
        hf = self.hf_config
        check_shardable(hf, self.tp_size)
        assert config.num_pages is not None  # set by EngineConfig.__post_init__
        return KVPool(
            num_layers=hf.num_hidden_layers,
            num_pages=config.num_pages,
            num_kv_heads=hf.num_key_value_heads // self.tp_size,
            page_size=config.page_size,
            head_dim=head_dim,
            dtype=config.kv_torch_dtype,
            device=self.device,
            tensor=self._shard,
        )
