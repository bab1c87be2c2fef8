"""The host tier gives the same results on both tree cores: random operations in lockstep.

The two cores are driven directly (``Core``) with the same seeded sequence of inserts,
matches, evictions with ``backup`` (and nodes to ``keep``), ``evict_host``, ``write_through``,
``load_back`` (of fresh and stale matches), locks, ``next_victim``, ``back_up`` and
``drop_host_copy`` (of good and bad nodes and answers); after every operation the results,
the callbacks' arguments and order, the whole tree (keys, tiers, device and host values,
locks, hits, stamps) and every size and counter must be equal. Node ids come from one
counter per core module, so they agree too (the test aligns the pure core's counter), and
with them the eviction order's ties.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from radixcache._core import CORES

pytestmark = pytest.mark.skipif(
    "c" not in CORES, reason="the compiled core is not built (nothing to compare)")

COUNTERS = ("evictable", "protected", "host_size", "lookups", "matched_tokens",
            "queried_tokens", "inserts", "inserted_tokens", "evictions", "evicted_tokens",
            "host_hit_tokens", "loaded_tokens", "backed_up_tokens", "host_evictions",
            "host_evicted_tokens")


def _values(tensor):
    return None if tensor is None else tensor.tolist()


def snapshot(core) -> tuple:
    nodes = []
    for node, depth in core.tree.iter_nodes():
        nodes.append((depth, node.id, node.key.tolist(), repr(node.extra_key), node.tier,
                      node.on_device, _values(node.value), _values(node.host_value),
                      node.lock_ref, node.hit_count, node.last_access_time, node.terminal,
                      node.priority, node.evicted, node.num_children))
    return (nodes, tuple(getattr(core, name) for name in COUNTERS), core.tree.node_count,
            core.tree.num_splits, len(core.heap) > 0, len(core.host_heap) > 0)


def plain(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", x.tolist())
    if isinstance(x, (list, tuple)):
        return [plain(y) for y in x]
    return x


def node_view(node):
    return None if node is None else (node.id, node.key.tolist(), node.tier)


class Driver:
    """One core and what the engine keeps: the host pool's next free index, matches, locks."""

    def __init__(self, module, page_size, policy, hits):
        self.core = module.Core(page_size, policy, True, hits)
        self.next_host = 10_000
        self.matches: list = []
        self.locked: list = []

    def step(self, op: dict) -> tuple:
        core = self.core
        log: list = []
        calls = [0]

        def backup(device):
            calls[0] += 1
            log.append(("backup", device.tolist()))
            if calls[0] > op["host_room"]:
                return None  # the host is full
            if calls[0] == op["raise_at"]:
                raise KeyError("host pool")
            start = self.next_host
            self.next_host += len(device)
            return torch.arange(start, start + len(device))

        def free(value):
            log.append(("free", plain(value), core.evictable, core.host_size))
            if op["requeue"] and not op["batch"]:
                # Per node, the guard released: push back on the heap every device node
                # whose children are all host only (a victim skipped earlier in this call
                # among them), by locking and unlocking it, and maybe free host room.
                for node, depth in list(core.tree.iter_nodes()):
                    if (depth and node.on_device and not node.lock_ref and node.children
                            and not any(c.on_device for c in node.children)):
                        core.lock(node, 1)
                        core.lock(node, -1)
                if op["requeue"] == "and free host":
                    core.evict_host(op["num"])

        def hook(name):
            return lambda node: log.append((name, node_view(node)))

        kind, tokens = op["kind"], op["tokens"]
        keep = None
        if op["keep"]:  # some leaves of either tier the call must leave in place
            nodes = [node for node, depth in core.tree.iter_nodes()
                     if depth and not any(c.on_device for c in node.children)]
            keep = {node for i, node in enumerate(nodes) if (i + op["keep"]) % 3 == 0}
        try:
            if kind == "insert":
                kv = None
                if op["kv"] == "array":
                    kv = np.arange(op["base"], op["base"] + len(tokens), dtype=np.int64)
                elif op["kv"] == "tensor":
                    kv = torch.arange(op["base"], op["base"] + len(tokens))
                result = core.insert(tokens, kv, op["extra_key"], op["priority"], op["held"])
                if result is None:  # declined (an empty tensor): cache.py's canonical call
                    core.enter("insert")
                    try:
                        canonical = None if kv is None else np.asarray(kv, dtype=np.int64)
                        result = core.insert(np.asarray(tokens, dtype=np.int64), canonical,
                                             op["extra_key"], op["priority"], True)
                    finally:
                        core.leave()
                adopted = [(node_view(n), s) for n, s in core.take_adopted()]
                leaf = core.take_new_leaf()
                out = (result.prefix_len, node_view(result.last_node), adopted,
                       node_view(leaf))
            elif kind == "match":
                m = core.match(tokens, op["extra_key"])
                self.matches.append(m)
                out = (m.length, m.host_length, m.indices.tolist(), node_view(m.last_node),
                       node_view(m.last_host_node))
            elif kind == "evict":
                def free_host(value):
                    log.append(("free_host", plain(value), core.host_size))

                out = core.evict(op["num"], free, op["batch"], hook("remove"),
                                 backup if op["backup"] else None, hook("on_backup"),
                                 free_host if op["free_host"] else None,
                                 hook("remove_host"), keep)
            elif kind == "evict_host":
                out = core.evict_host(op["num"], free if op["free"] else None, op["batch"],
                                      hook("remove"), keep)
            elif kind == "next_victim":
                out = node_view(core.next_victim(op["host_node"], keep))
            elif kind in ("back_up", "drop_host_copy"):
                if not self.matches:
                    return ("no match",)
                m = self.matches[op["pick"] % len(self.matches)]
                node = m.last_host_node if op["host_node"] else m.last_node
                if kind == "drop_host_copy":
                    out = core.drop_host_copy(node, hook("remove_host")).tolist()
                else:
                    n = node.num_tokens + op["wrong"]
                    host = torch.arange(self.next_host, self.next_host + max(n, 0))
                    self.next_host += max(n, 0)
                    out = core.back_up(node, host, hook("on_backup"))
            elif kind == "write_through":
                out = core.write_through(backup, hook("on_backup"))
            elif kind == "load_back":
                if not self.matches:
                    return ("no match",)
                m = self.matches[op["pick"] % len(self.matches)]
                n = m.host_length + op["wrong"]
                if op["as_tensor"]:
                    values = torch.arange(5000, 5000 + max(n, 0))
                else:
                    values = np.arange(5000, 5000 + max(n, 0), dtype=np.int64)
                out = core.load_back(m, values, hook("load")).tolist()
            elif kind == "lock":
                if not self.matches:
                    return ("no match",)
                m = self.matches[op["pick"] % len(self.matches)]
                node = m.last_host_node if op["host_node"] else m.last_node
                out = core.lock(node, 1)
                self.locked.append(node)
            elif kind == "unlock":
                if not self.locked:
                    return ("no lock",)
                out = core.lock(self.locked.pop(op["pick"] % len(self.locked)), -1)
            else:
                out = (core.exists(tokens, op["extra_key"]), core.walk(tokens, op["extra_key"]))
        except Exception as exc:  # compared across cores
            out = ("raised", type(exc).__name__, str(exc))
        return out, log


KINDS = ["insert"] * 4 + ["match"] * 3 + ["evict"] * 2 + ["evict_host", "write_through",
                                                          "load_back", "lock", "unlock",
                                                          "exists", "next_victim", "back_up",
                                                          "drop_host_copy"]


def random_op(rng: random.Random, page_size: int) -> dict:
    length = rng.randint(0, 8) * page_size + (rng.random() < 0.1)
    return {
        "kind": rng.choice(KINDS),
        "tokens": [rng.randint(0, 3) for _ in range(length)],
        "extra_key": rng.choice([None, None, None, "ns"]),
        "priority": rng.choice([0, 0, 0, 1, -1]),
        "held": rng.random() < 0.5,
        "kv": rng.choice([None, "array", "tensor"]),
        "base": rng.randint(0, 1000),
        "num": rng.randint(0, 7),
        "batch": rng.random() < 0.3,
        "backup": rng.random() < 0.85,
        "free": rng.random() < 0.8,
        "host_room": rng.randint(0, 5),
        "raise_at": rng.randint(0, 15),
        "pick": rng.randint(0, 50),
        "wrong": 0 if rng.random() < 0.9 else rng.choice([-1, 1]),
        "as_tensor": rng.random() < 0.3,
        "requeue": rng.choice([None, None, "push", "and free host"]),
        "free_host": rng.random() < 0.5,
        "host_node": rng.random() < 0.3,
        "keep": 0 if rng.random() < 0.6 else rng.randint(1, 3),
    }


@pytest.mark.parametrize("policy,hits,page_size", [
    ("lru", 0, 1), ("lru", 1, 1), ("lfu", 2, 2), ("mru", 0, 1), ("fifo", 1, 2),
    ("slru", 0, 1), ("filo", 2, 1), ("priority", 0, 2),
])
@pytest.mark.parametrize("seed", range(6))
def test_cores_agree_on_the_host_tier(policy, hits, page_size, seed):
    from radixcache import _core_c, _core_py, _tree_py

    rng = random.Random(f"{policy}-{hits}-{page_size}-{seed}")
    # The next node gets the same id on both cores (ids show in messages and break ties).
    _tree_py._next_id = _core_c.Core(1, "lru").tree.root.id
    compiled = Driver(_core_c, page_size, policy, hits)
    pure = Driver(_core_py, page_size, policy, hits)
    for step in range(250):
        op = random_op(rng, page_size)
        got, want = compiled.step(op), pure.step(op)
        assert got == want, (step, op)
        assert snapshot(compiled.core) == snapshot(pure.core), (step, op)
    compiled.core.tree.check_layout()
