"""The disk KV tier reading through real NIXL's POSIX file backend (``fabric_bridge/file_reader.py``):
blocks come back equal to what was written, in batches, with the backend's default I/O mode (POSIX
AIO; the other modes were measured side by side: ``perf/history/experiments.md``); a
damaged or truncated file is refused (never loaded) as with plain file I/O; a
read NIXL cannot do raises, and the tier then reads with plain file I/O. Through a real server:
``test_kv_tiers_e2e.py`` (a restarted server's disk-tier hits, read with NIXL's POSIX backend)."""

from __future__ import annotations

import os

import pytest
import torch

from backend.engine.disk_tier import DiskTier
from backend.engine.file_reader import PlainFileReader
from fabric_bridge.file_reader import NixlFileReader

SHAPE = (30, 2, 3, 16, 64)  # SmolLM2-135M's block: 737,280 bytes


def _reader(mode: str = "posix_aio") -> NixlFileReader:
    return NixlFileReader(mode)  # the default must start wherever the suite runs


def _written(folder, n: int) -> tuple[list[bytes], list[torch.Tensor]]:
    torch.manual_seed(0)
    blocks = [torch.randn(SHAPE) for _ in range(n)]
    keys = [i.to_bytes(16, "little") for i in range(n)]
    tier = DiskTier(folder, 1 << 40, b"salt", {"l": 30}, SHAPE, torch.float32)
    for key, block in zip(keys, blocks):
        tier.put(key, block, wait_s=30)
    tier.close()
    return keys, blocks


def test_blocks_read_through_nixl_equal_what_was_written(tmp_path):
    mode = "posix_aio"
    keys, blocks = _written(tmp_path, 50)
    tier = DiskTier(tmp_path, 1 << 40, b"salt", {"l": 30}, SHAPE, torch.float32, reader=_reader(mode))
    assert tier.batch_blocks == 45  # 32 MiB of staging: two batches here
    got = []
    for at in range(0, len(keys), tier.batch_blocks):
        got += [b.clone() for b in tier.read_many(keys[at : at + tier.batch_blocks])]
    assert all(torch.equal(a, b) for a, b in zip(got, blocks))
    assert tier.reader.name == f"NIXL POSIX ({mode})"  # it did not give way to plain file I/O
    assert tier.stats()["reads"] == 50 and tier.stats()["read_errors"] == 0
    tier.close()


def test_a_damaged_or_truncated_file_read_through_nixl_is_refused(tmp_path):
    keys, blocks = _written(tmp_path, 6)
    tier = DiskTier(tmp_path, 1 << 40, b"salt", {"l": 30}, SHAPE, torch.float32, reader=_reader("posix_aio"))
    damaged, short = tier.path(keys[1]), tier.path(keys[4])
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    short.write_bytes(short.read_bytes()[:-64])
    got = tier.read_many(keys)
    assert [b is None for b in got] == [False, True, False, False, True, False]
    assert all(torch.equal(got[i], blocks[i]) for i in (0, 2, 3, 5))
    assert tier.stats()["corrupt"] == 2 and not damaged.exists() and not short.exists()
    assert tier.reader.name == "NIXL POSIX (posix_aio)"
    tier.close()


def test_a_read_nixl_cannot_do_raises_and_the_tier_reads_plainly(tmp_path, caplog):
    keys, blocks = _written(tmp_path, 3)
    reader = _reader("posix_aio")
    fd = os.open(tmp_path / "empty", os.O_RDWR | os.O_CREAT, 0o644)  # shorter than the read asks
    os.close(fd)  # a closed descriptor: NIXL refuses it
    with pytest.raises(OSError, match="NIXL POSIX read of 1 file.s. failed"):
        reader.read([fd], 4096, torch.empty(4096, dtype=torch.uint8))
    tier = DiskTier(tmp_path, 1 << 40, b"salt", {"l": 30}, SHAPE, torch.float32, reader=reader)
    reader.close()  # a reader that no longer works: the tier gives way to plain file I/O
    with caplog.at_level("WARNING", logger="triton_disagg.engine"):
        got = tier.read_many(keys)
    assert all(torch.equal(a, b) for a, b in zip(got, blocks))
    assert isinstance(tier.reader, PlainFileReader)
    assert "NIXL POSIX (posix_aio) failed" in caplog.text and "reading with plain file I/O" in caplog.text
    tier.close()
