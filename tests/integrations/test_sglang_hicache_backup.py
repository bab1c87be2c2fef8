"""Host copies are backed up to storage as SGLang 0.5.23 backs them up: the HiCache
differential of ``test_sglang_hicache.py`` (SGLang's default cache against
``--radix-cache-backend radixcache``, both with SGLang's own host pools and controller,
compared after every step: match lengths and storage keys, request rows, device and host free
slots, sizes, queued transfers, KV events per medium) with SGLang's ``file`` storage backend
attached to both sides, each in its own directory: SGLang's side through its own admin call
(``attach_storage_backend``), radixcache's through ``HiCacheBackend._attach_storage``
(what its start-up with ``--hicache-storage-backend file`` calls: attaching at run time is
refused). After every step
both also show the same host locks per node (SGLang's ``host_lock_ref``: the storage writes
in flight hold their nodes' host copies), the same storage hashes of every node with a host
copy, the same storage writes acknowledged and waiting (host slots, keys, the keys of the
pages above them where the backend asks for those, tokens written) and the same files in
their storage directories.

One stand-in, the same for both sides: the controller's backup thread runs on its own, so
before every step start (``check_hicache_events``, which takes as many acknowledgements as
were queued when it began) and every comparison the test waits until that thread has
acknowledged every storage write queued (a storage backend faster than a scheduler step);
without the wait, how many acknowledgements a step takes would depend on thread timing.
"""

from __future__ import annotations

import json
import os
import time
import zlib

import pytest
from test_sglang_hicache import (  # noqa: F401 -- cpu_hicache is a fixture
    STEPS,
    HiReplay,
    HiSide,
    cpu_hicache,
    run,
)

from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_parallel



#: One rank's place in every parallel group (what attaching a storage backend reads).
ONE_RANK = {f"{group}_{what}": 0 if what == "rank" else 1
            for group in ("tp", "pp", "attn_tp", "attn_cp", "attn_dcp", "dcp")
            for what in ("rank", "size")}


class BackupSide(HiSide):
    """A ``HiSide`` with a storage backend: waits for the backup thread before each step
    start, and reads the storage state both sides must share."""

    storage_dir = ""

    def outstanding(self) -> dict:
        """The storage writes not taken yet: write id -> what the side keeps for it."""
        real = self.real
        return real.ongoing_backup if isinstance(real, UnifiedRadixCache) else real._backups

    def settle(self) -> None:
        """Wait until the backup thread has acknowledged every storage write queued."""
        cc = self.real.cache_controller
        deadline = time.monotonic() + 30
        while not (cc.backup_queue.empty()
                   and cc.ack_backup_queue.qsize() == len(self.outstanding())):
            assert time.monotonic() < deadline, "the backup thread stopped acknowledging"
            time.sleep(0.0002)

    def tick(self) -> tuple:
        self.settle()
        return super().tick()

    def nodes(self) -> list:
        """(path tokens, node) of every node, parents first."""
        real = self.real
        if isinstance(real, UnifiedRadixCache):
            root = real.tree_core.root_node
            children = lambda node: list(node.children.values())  # noqa: E731
            tokens = lambda node: tuple(node.key.token_ids)  # noqa: E731
        else:
            root = real.radix_cache.root_node
            children = lambda node: list(node.children)  # noqa: E731
            tokens = lambda node: tuple(int(t) for t in node.key)  # noqa: E731
        found, stack = [], [((), child) for child in children(root)]
        while stack:
            path, node = stack.pop()
            path += tokens(node)
            found.append((path, node))
            stack.extend((path, child) for child in children(node))
        return found

    def host_locks(self, node) -> int:
        real = self.real
        if isinstance(real, UnifiedRadixCache):
            return node.component_data[ComponentType.FULL].host_lock_ref
        return real._host_locks.get(node, 0) + real._backup_held().get(node, 0)

    def storage_state(self) -> tuple:
        """Per node with a host copy: its path, host locks, backed up or not, its storage
        hashes; the storage writes acknowledged, in order (host slots, keys, the keys above
        them, tokens written); the files written."""
        self.settle()
        cache = self.cache
        own = isinstance(self.real, UnifiedRadixCache)  # (its calls take node ids)
        nodes = []
        for path, node in self.nodes():
            ref = node.id if own else node
            locks = self.host_locks(node)
            if locks or cache.is_backuped(ref):
                nodes.append((path, locks, cache.is_backuped(ref),
                              cache.get_last_hash_value(ref),
                              tuple(cache.get_prefix_hash_values(ref))))
        nodes.sort()
        cc = self.real.cache_controller
        acked = [(op.host_indices.tolist(), list(op.hash_value), op.prefix_keys,
                  op.completed_tokens)
                 for op in list(cc.ack_backup_queue.queue)]
        return nodes, acked, sorted(os.listdir(self.storage_dir))


class BackupReplay(HiReplay):
    """``HiReplay`` with SGLang's ``file`` storage backend attached to both sides."""

    def __init__(self, core, page_size, write_policy, seed, monkeypatch, tmp_path,
                 fail_keys=None, host_ratio=1.0, prefetch_threshold=None) -> None:
        super().__init__(core, page_size, "lru", write_policy, host_ratio, seed, monkeypatch)
        monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
        for name, side in (("sglang", self.sgl), ("radixcache", self.ours)):
            side.__class__ = BackupSide
            side.storage_dir = str(tmp_path / name)
            # (pages of 16 also pass each write the keys of the pages above it)
            config = {"file_storage_path": side.storage_dir,
                      "hicache_storage_pass_prefix_keys": page_size == 16}
            if prefetch_threshold is not None:
                config["prefetch_threshold"] = prefetch_threshold
            config = json.dumps(config)
            # (the storage config reads this process's place in the TP group: one rank)
            with get_parallel().override(**ONE_RANK):
                if side is self.sgl:
                    ok, message = side.real.attach_storage_backend(
                        "file", storage_backend_extra_config_json=config)
                    assert ok, message
                else:
                    side.real._attach_storage("file", config)
            assert side.real.enable_storage
            if fail_keys is not None:
                backend = side.real.cache_controller.storage_backend
                monkeypatch.setattr(backend, "batch_set", fail_keys(backend.batch_set, self))

    def compare(self, what: str) -> None:
        super().compare(what)
        if not isinstance(self.ours, BackupSide):
            return  # (the comparison at the start, before the backends are attached)
        where = f"after step {self.steps} ({what})"
        sgl, ours = self.sgl.storage_state(), self.ours.storage_state()
        assert sgl[0] == ours[0], f"host locks or storage hashes differ {where}"
        assert sgl[1] == ours[1], f"storage writes differ {where}"
        assert sgl[2] == ours[2], f"storage files differ {where}"
        self.counts["backed up"] = max(self.counts.get("backed up", 0), len(sgl[2]))
        held = sum(locks for _, locks, *_ in sgl[0])
        self.counts["held"] = self.counts.get("held", 0) + (held > 0)

    def close(self) -> None:
        try:
            for side in (self.sgl, self.ours):
                side.real.detach_storage_backend()
        finally:
            super().close()


@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
@pytest.mark.parametrize("write_policy", ("write_back", "write_through",
                                          "write_through_selective"))
@pytest.mark.usefixtures("cpu_hicache")
def test_backups_same_as_sglang(backend_core, monkeypatch, tmp_path, write_policy, page_size):
    seed = zlib.crc32(f"backup-{write_policy}-{page_size}".encode())
    replay = BackupReplay(backend_core, page_size, write_policy, seed, monkeypatch, tmp_path)
    run(replay, STEPS // 8)
    counts = replay.counts
    assert counts.get("backed up", 0) > 5 and counts.get("held", 0) > 5, counts
    assert counts.get("finished", 0) > 5, counts


def _failing_writes(batch_set, replay):
    """The storage backend's ``batch_set``, failing for some keys (a page's key decides, the
    same on both sides): it answers False for one, raises for another."""

    def maybe_fail(keys, *args, **kwargs):
        verdict = zlib.crc32(keys[0].encode()) % 4
        if verdict == 0:
            return False
        if verdict == 1:
            raise OSError("injected storage write failure")
        return batch_set(keys, *args, **kwargs)
    return maybe_fail


@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
@pytest.mark.parametrize("write_policy", ("write_back", "write_through"))
@pytest.mark.usefixtures("cpu_hicache")
def test_failed_backups_release_their_locks(backend_core, monkeypatch, tmp_path, write_policy,
                                            page_size):
    """Storage writes that fail or raise: both sides alike, every host slot free or held
    once, and every host lock released once the writes are acknowledged."""
    seed = zlib.crc32(f"backup-faults-{write_policy}-{page_size}".encode())
    replay = BackupReplay(backend_core, page_size, write_policy, seed, monkeypatch, tmp_path,
                          fail_keys=_failing_writes, host_ratio=0.5)
    try:
        for _ in range(STEPS // 16):
            replay.step()
        for _ in range(2):  # the first takes the copies' acks: their storage writes start
            replay.both("tick")
        replay.compare("drained")
        assert not replay.ours.real._backups and not replay.sgl.real.ongoing_backup
        assert not any(replay.ours.host_locks(node) for _, node in replay.ours.nodes()
                       if node not in replay.ours.real._host_locks)
    finally:
        replay.close()
