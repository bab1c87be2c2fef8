"""A tree core of numpy arrays (``Core(..., numpy_arrays=True)``), driven directly.

Every index array it makes or hands out is a new 1-D int64 numpy array, holding what the
same core of torch arrays gives as a tensor; it never imports torch (checked in a fresh
interpreter); a tensor input before torch is bound is declined (cache.py converts it), and
``backup``'s answer must be a numpy array.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from radixcache._core import CORES, RadixTreeNode

REPO = Path(__file__).resolve().parents[1]


def numpy_core(core_name: str, *args, **kwargs):
    try:
        return CORES[core_name].Core(*args, numpy_arrays=True, **kwargs)
    except TypeError as exc:
        if "numpy_arrays" not in str(exc):
            raise
        pytest.skip(f"the {core_name!r} core has no numpy_arrays mode yet")


def check_array(value, length: int | None = None) -> np.ndarray:
    assert type(value) is np.ndarray, type(value)
    assert value.dtype == np.int64 and value.ndim == 1
    assert value.flags.writeable
    if length is not None:
        assert value.shape == (length,)
    return value


def run_python(core_name: str, body: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # The core's own module only (the chooser would load the other core too).
    script = ("import importlib, sys\ncore_module = importlib.import_module(sys.argv[1])\n"
              + textwrap.dedent(body))
    proc = subprocess.run([sys.executable, "-c", script, CORES[core_name].__name__],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# -- results, one kind at a time ----------------------------------------------------------
def test_the_mode_is_a_read_only_attribute(core_name):
    core = numpy_core(core_name, 1, "lru")
    assert core.numpy_arrays is True
    assert CORES[core_name].Core(1, "lru").numpy_arrays is False
    with pytest.raises(AttributeError):
        core.numpy_arrays = False
    assert core.numpy_arrays is True


def test_match_insert_and_node_values_are_numpy_arrays(core_name):
    core = numpy_core(core_name, 2, "lru")
    miss = core.match([1, 2, 3, 4])
    check_array(miss.indices, 0)
    assert miss.last_node is core.tree.root
    core.insert([1, 2, 3, 4], np.array([10, 11, 12, 13]))
    core.insert([1, 2, 5, 6], [20, 21, 22, 23])
    core.insert([7, 8])  # no kv: the tokens serve as indices
    hit = core.match([1, 2, 3, 4, 9])
    assert check_array(hit.indices, 4).tolist() == [10, 11, 12, 13]
    hit.indices[:] = -1  # the caller's own copy
    assert core.match([1, 2, 3, 4]).indices.tolist() == [10, 11, 12, 13]
    assert check_array(core.match([7, 8]).indices).tolist() == [7, 8]
    for node, _ in core.tree.iter_nodes():
        value = check_array(node.value, node.num_tokens)
        kept = value.tolist()
        value[:] = -1  # a new array: the node keeps its values
        assert node.value.tolist() == kept
        assert node.host_value is None
    leaf = core.match([1, 2, 5, 6]).last_node
    assert isinstance(leaf, RadixTreeNode) and isinstance(core.tree.root, RadixTreeNode)
    assert check_array(leaf.stored_value).tolist() == [22, 23]
    assert core.match([7, 8]).last_node.stored_value is None
    hit.close()
    check_array(hit.indices, 0)


@pytest.mark.parametrize("batch", [False, True])
def test_evict_hands_over_numpy_arrays(core_name, batch):
    core = numpy_core(core_name, 1, "lru")
    core.insert([1, 2, 3], np.array([10, 11, 12]))
    core.insert([1, 2, 4], np.array([10, 11, 14]))
    core.insert([5, 6])
    freed = []
    assert core.evict(100, freed.append, batch) == 6
    for value in freed:
        check_array(value)
    assert sorted(np.concatenate(freed).tolist()) == [5, 6, 10, 11, 12, 14]
    assert len(freed) == (1 if batch else 4)
    assert core.tree.node_count == 0


@pytest.mark.parametrize("batch", [False, True])
def test_the_host_tier_hands_over_numpy_arrays(core_name, batch):
    core = numpy_core(core_name, 2, "lru", True)
    core.insert([1, 2, 3, 4], np.arange(100, 104))
    core.insert([1, 2, 5, 6], np.arange(200, 204))
    backed, freed = [], []

    def backup(device):
        backed.append(check_array(device).tolist())
        return device + 1000

    assert core.evict(4, freed.append, batch, None, backup) == 4
    assert sorted(backed) == [[102, 103], [202, 203]]
    assert sorted(np.concatenate([check_array(v) for v in freed]).tolist()) == [
        102, 103, 202, 203]
    tiers = {tuple(node.key.tolist()): node for node, _ in core.tree.iter_nodes()}
    assert check_array(tiers[(3, 4)].host_value).tolist() == [1102, 1103]
    assert tiers[(3, 4)].value is None and tiers[(5, 6)].tier == "host"
    match = core.match([1, 2, 3, 4])
    assert check_array(match.indices).tolist() == [100, 101] and match.host_length == 2
    loaded = core.load_back(match, np.array([50, 51]))
    assert check_array(loaded).tolist() == [1102, 1103]
    assert check_array(tiers[(3, 4)].value).tolist() == [50, 51]
    empty = core.load_back(core.match([1, 2, 3, 4]), np.empty(0, dtype=np.int64))
    check_array(empty, 0)
    freed.clear()
    assert core.evict_host(100, freed.append, batch) == 2
    assert [check_array(v).tolist() for v in freed] == [[1202, 1203]]


def test_write_through_backs_up_numpy_arrays(core_name):
    core = numpy_core(core_name, 1, "lru", True, 1)
    core.insert([1, 2, 3], np.array([5, 6, 7]))
    assert core.write_through(lambda device: check_array(device, 3) * 2) == 3
    node = core.match([1, 2, 3]).last_node
    assert node.tier == "device+host"
    assert check_array(node.host_value).tolist() == [10, 12, 14]


@pytest.mark.parametrize("answer,error,message", [
    (lambda d: torch.from_numpy(d.copy()), TypeError, "must return a numpy array"),
    (lambda d: d.tolist(), TypeError, "must return a numpy array"),
    (lambda d: d.astype(np.int32), TypeError, "dtype int64"),
    (lambda d: d.reshape(1, -1), ValueError, "1-D"),
    (lambda d: d[:1], ValueError, "one per slot"),
])
def test_backup_must_answer_a_numpy_array(core_name, answer, error, message):
    core = numpy_core(core_name, 1, "lru", True, 1)
    core.insert([1, 2, 3], np.array([5, 6, 7]))
    with pytest.raises(error, match=message):
        core.write_through(answer)
    node = core.match([1, 2, 3]).last_node
    assert node.tier == "device" and core.host_size == 0
    assert core.write_through(lambda d: d + 1) == 3  # still queued, at the front
    evicting = numpy_core(core_name, 1, "lru", True)
    evicting.insert([1, 2, 3], np.array([5, 6, 7]))
    with pytest.raises(error, match=message):
        evicting.evict(3, None, False, None, answer)
    assert evicting.evictable == 3 and evicting.host_size == 0
    assert evicting.match([1, 2, 3]).indices.tolist() == [5, 6, 7]


def test_a_state_with_device_values_is_refused(core_name):
    source = numpy_core(core_name, 1, "lru")
    source.insert([1, 2, 3], np.array([5, 6, 7]))
    state = source.export_state()
    copy = numpy_core(core_name, 1, "lru")
    copy.import_state(state)
    assert check_array(copy.match([1, 2, 3]).indices).tolist() == [5, 6, 7]
    record = list(state["nodes"][0])
    record[2] = torch.zeros(3, dtype=torch.int64, device="meta")
    state["nodes"][0] = tuple(record)
    refusing = numpy_core(core_name, 1, "lru")
    with pytest.raises(ValueError, match="bad tree state: .*CPU values only"):
        refusing.import_state(state)
    assert refusing.tree.node_count == 0


# -- no torch --------------------------------------------------------------------------------
def test_a_numpy_core_never_imports_torch(core_name):
    numpy_core(core_name, 1, "lru")  # skips where the mode is missing
    out = run_python(core_name, """
        import numpy as np
        assert "torch" not in sys.modules
        core = core_module.Core(2, "lru", True, numpy_arrays=True)
        core.insert([1, 2, 3, 4], np.arange(4))
        core.insert([1, 2, 5, 6], [7, 8, 9, 10])
        match = core.match([1, 2, 3, 4])
        freed = []
        core.evict(2, freed.append, True, None, lambda d: d + 100)
        core.evict(2, freed.append, False, None, lambda d: d + 200)
        match = core.match([1, 2, 5, 6])
        core.load_back(match, np.array([40, 41]))
        core.evict_host(100, freed.append, True)
        walled = core_module.Core(1, "lru", True, 1, numpy_arrays=True)
        walled.insert([1, 2])
        walled.write_through(lambda d: d + 1)
        print(sorted(type(v).__name__ for v in freed), "torch" in sys.modules)
    """)
    assert out.split("]")[1].strip() == "False", out
    assert "Tensor" not in out


def test_a_tensor_is_declined_until_torch_is_bound(core_name):
    numpy_core(core_name, 1, "lru")  # skips where the mode is missing
    out = run_python(core_name, """
        from radixcache import _shared
        core = core_module.Core(1, "lru", numpy_arrays=True)
        core.insert([9, 9])
        before = (core.tree.node_count, core.tree.clock, core.lookups, core.inserts)
        import torch
        tokens = torch.tensor([1, 2, 3])
        print(core.match(tokens), core.insert(tokens), core.insert([1, 2, 3], tokens),
              core.exists(tokens))
        assert (core.tree.node_count, core.tree.clock, core.lookups, core.inserts) == before
        assert _shared.is_tensor(tokens)  # cache.py's check: torch is bound from here on
        core.insert(tokens, tokens + 10)
        indices = core.match(tokens).indices
        print(type(indices).__name__, indices.tolist())
    """)
    assert out.splitlines() == ["None None None None", "ndarray [11, 12, 13]"], out


# -- the same operations give the same values in both modes ------------------------------------
def _plain(value):
    if isinstance(value, torch.Tensor):
        return ("array", value.tolist())
    if isinstance(value, np.ndarray):
        return ("array", check_array(value).tolist())
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _view(node):
    return None if node is None else (node.key.tolist(), node.tier, node.num_children)


def _snapshot(core) -> list:
    out = []
    for node, depth in core.tree.iter_nodes():
        out.append((depth, _view(node), _plain(node.value), _plain(node.host_value),
                    node.lock_ref, node.hit_count, node.last_access_time))
    out.append((core.evictable, core.protected, core.host_size, core.evictions,
                core.evicted_tokens, core.backed_up_tokens, core.loaded_tokens))
    return out


class Driver:
    def __init__(self, core, numpy_arrays: bool) -> None:
        self.core = core
        self.numpy = numpy_arrays
        self.next_host = 10_000
        self.matches: list = []
        self.locked: list = []

    def step(self, op: dict):
        core = self.core
        log: list = []
        calls = [0]

        def backup(device):
            kind = np.ndarray if self.numpy else torch.Tensor
            assert type(device) is kind
            calls[0] += 1
            log.append(("backup", _plain(device)))
            if calls[0] > op["host_room"]:
                return None
            start = self.next_host
            self.next_host += len(device)
            if self.numpy:
                return np.arange(start, start + len(device), dtype=np.int64)
            return torch.arange(start, start + len(device))

        def free(value):
            log.append(("free", _plain(value)))

        kind, tokens = op["kind"], op["tokens"]
        try:
            if kind == "insert":
                kv = None
                if op["kv"]:
                    kv = np.arange(op["base"], op["base"] + len(tokens), dtype=np.int64)
                result = core.insert(tokens, kv, None, op["priority"])
                out = (result.prefix_len, _view(result.last_node))
            elif kind == "match":
                m = core.match(tokens)
                self.matches.append(m)
                out = (m.length, m.host_length, _plain(m.indices), _view(m.last_node))
            elif kind == "evict":
                out = core.evict(op["num"], free, op["batch"], None,
                                 backup if op["backup"] else None)
            elif kind == "evict_host":
                out = core.evict_host(op["num"], free, op["batch"])
            elif kind == "write_through":
                out = core.write_through(backup)
            elif kind == "load_back":
                if not self.matches:
                    return ("no match",)
                m = self.matches[op["pick"] % len(self.matches)]
                values = np.arange(5000, 5000 + m.host_length, dtype=np.int64)
                out = _plain(core.load_back(m, values))
            elif kind == "lock":
                if not self.matches:
                    return ("no match",)
                node = self.matches[op["pick"] % len(self.matches)].last_node
                out = core.lock(node, 1)
                self.locked.append(node)
            else:
                if not self.locked:
                    return ("no lock",)
                out = core.lock(self.locked.pop(op["pick"] % len(self.locked)), -1)
        except Exception as exc:  # noqa: BLE001 -- compared across modes
            # Node ids come from one counter per core module: they differ between the two.
            out = ("raised", type(exc).__name__, re.sub(r"\d+", "#", str(exc)))
        return out, log


KINDS = ["insert"] * 4 + ["match"] * 3 + ["evict"] * 2 + ["evict_host", "write_through",
                                                          "load_back", "lock", "unlock"]


@pytest.mark.parametrize("host_tier,hits", [(False, 0), (True, 0), (True, 1)])
@pytest.mark.parametrize("seed", range(4))
def test_both_modes_give_the_same_values(core_name, host_tier, hits, seed):
    module = CORES[core_name]
    page_size = 1 + seed % 2
    arrays = Driver(numpy_core(core_name, page_size, "lru", host_tier, hits), True)
    tensors = Driver(module.Core(page_size, "lru", host_tier, hits), False)
    rng = random.Random(f"{host_tier}-{hits}-{seed}")
    for step in range(200):
        length = rng.randint(0, 6) * page_size + (rng.random() < 0.1)
        op = {"kind": rng.choice(KINDS), "tokens": [rng.randint(0, 3) for _ in range(length)],
              "kv": rng.random() < 0.7, "base": rng.randint(0, 1000),
              "priority": rng.choice([0, 0, 1]), "num": rng.randint(0, 7),
              "batch": rng.random() < 0.4, "backup": rng.random() < 0.8,
              "host_room": rng.randint(0, 4), "pick": rng.randint(0, 50)}
        if not host_tier and op["kind"] in ("evict_host", "write_through", "load_back"):
            continue
        assert arrays.step(op) == tensors.step(op), (step, op)
        assert _snapshot(arrays.core) == _snapshot(tensors.core), (step, op)
