"""Core-level checks of numpy index arrays: ``Core(..., numpy_arrays=True)`` on both cores.

Every index array such a core makes is a new, writable 1-D int64 numpy array (never a
tensor), with the values a torch-mode core gives; the core modules import without torch,
and a numpy-array core never imports it.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import HAS_TORCH, needs_torch
from radixcache import _state
from radixcache._core import CORES

if HAS_TORCH:  # else the cases that need it skip (needs_torch)
    import torch

REPO = Path(__file__).resolve().parents[2]


def numpy_core(core_name, page_size=1, policy="lru", host_tier=False, hits=0):
    return CORES[core_name].Core(page_size, policy, host_tier, hits, numpy_arrays=True)


def torch_core(core_name, page_size=1, policy="lru", host_tier=False, hits=0):
    return CORES[core_name].Core(page_size, policy, host_tier, hits)


def assert_index_array(value, expected=None):
    """``value`` is a new writable 1-D int64 numpy array (holding ``expected``)."""
    assert type(value) is np.ndarray, type(value)
    assert value.dtype == np.int64 and value.ndim == 1
    assert value.flags.writeable and value.flags.c_contiguous
    if expected is not None:
        assert value.tolist() == list(expected)


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_attribute(core_name):
    core = numpy_core(core_name)
    assert core.numpy_arrays is True
    with pytest.raises(AttributeError):
        core.numpy_arrays = False


@needs_torch
def test_attribute_of_a_torch_core(core_name):
    core = torch_core(core_name)
    assert core.numpy_arrays is False
    with pytest.raises(AttributeError):
        core.numpy_arrays = True


def test_module_and_numpy_core_never_import_torch(core_name):
    """Importing a core and using a numpy-array core, host tier included, loads no torch;
    a torch-array core loads it in its constructor (without torch installed it raises,
    saying how to get it)."""
    module = CORES[core_name].__name__
    out = run_python(f"""
        import sys
        import numpy as np
        import {module} as m
        assert "torch" not in sys.modules, "import"
        core = m.Core(1, "lru", True, 0, numpy_arrays=True)
        core.insert([1, 2, 3, 4], [10, 11, 12, 13])
        core.insert([1, 2, 5], None)
        hit = core.match([1, 2, 3, 9])
        miss = core.match([7])
        host = iter(range(100, 200))
        backed = []
        def backup(device):
            backed.append(device)
            return np.array([next(host) for _ in device], dtype=np.int64)
        freed = []
        core.evict(10, freed.append, True, None, backup)
        m2 = core.match([1, 2, 3, 4])
        loaded = core.load_back(m2, np.array([20, 21, 22, 23], dtype=np.int64))
        core.evict_host(0)
        values = [hit.indices, miss.indices, loaded, *freed, *backed]
        assert all(type(v) is np.ndarray for v in values), [type(v) for v in values]
        assert "torch" not in sys.modules, "use"
        try:
            m.Core(1, "lru")
        except ModuleNotFoundError as exc:
            print("missing", "radixcache[torch]" in str(exc))
        else:
            print("torch" in sys.modules)
    """)
    assert out.split() == (["True"] if HAS_TORCH else ["missing", "True"])


def test_results_are_numpy(core_name):
    core = numpy_core(core_name)
    assert core.insert([1, 2, 3], [7, 8, 9]) is not None
    hit = core.match([1, 2, 3, 4])
    assert_index_array(hit.indices, [7, 8, 9])
    assert_index_array(core.match([5]).indices, [])
    assert_index_array(core.match([]).indices, [])
    core.insert([4, 5], None)  # the key doubles as the indices
    assert_index_array(core.match([4, 5]).indices, [4, 5])
    node = core.match([1, 2]).last_node  # a split
    assert_index_array(node.value, [7, 8])
    assert_index_array(node.children[0].value, [9])
    assert_index_array(node.stored_value, [7, 8])
    assert_index_array(core.tree.root.value, [])


def test_results_are_new_arrays(core_name):
    """A result owns its memory: writing into it changes neither the tree nor another."""
    core = numpy_core(core_name)
    core.insert([1, 2, 3], [7, 8, 9])
    first = core.match([1, 2, 3]).indices
    second = core.match([1, 2, 3]).indices
    assert not np.shares_memory(first, second)
    first[:] = -1
    assert second.tolist() == [7, 8, 9]
    node = core.match([1, 2, 3]).last_node
    value = node.value
    value[0] = -5
    assert node.value.tolist() == [7, 8, 9]
    assert core.match([1, 2, 3]).indices.tolist() == [7, 8, 9]
    assert core.match([9]).indices is not core.match([9]).indices


@pytest.mark.parametrize("batch", [False, True])
def test_evict_hands_numpy_arrays(core_name, batch):
    core = numpy_core(core_name)
    core.insert([1, 2, 3], [7, 8, 9])
    core.insert([1, 2, 5], [7, 8, 10])
    core.insert([6], None)
    got, removed = [], []
    freed = core.evict(100, got.append, batch, removed.append)
    assert freed == 5 and core.evictable == 0
    for value in got:
        assert_index_array(value)
    assert sorted(np.concatenate(got).tolist()) == [6, 7, 8, 9, 10]
    assert len(got) == (1 if batch else len(removed))
    assert all(node.evicted for node in removed)


@pytest.mark.parametrize("batch", [False, True])
def test_backup_and_host_tier_hand_numpy_arrays(core_name, batch):
    core = numpy_core(core_name, host_tier=True)
    core.insert([1, 2, 3, 4], [10, 11, 12, 13])
    core.insert([1, 2, 5, 6], [10, 11, 14, 15])
    backed = []

    def backup(device):
        backed.append((device, device.copy()))
        return device + 100

    freed = []
    assert core.evict(100, freed.append, batch, None, backup) == 6
    for device, copy in backed:
        assert_index_array(device)
        # what backup keeps still holds what it was given (a batch never writes there)
        assert device.tolist() == copy.tolist()
    for value in freed:
        assert_index_array(value)
    assert sorted(np.concatenate(freed).tolist()) == [10, 11, 12, 13, 14, 15]
    node = core.match([1, 2]).last_host_node
    assert_index_array(node.host_value, [110, 111])
    assert node.value is None
    match = core.match([1, 2, 3, 4])
    assert (match.length, match.host_length) == (0, 4)
    assert_index_array(match.indices, [])
    loaded = core.load_back(match, np.array([20, 21, 22, 23], dtype=np.int64))
    assert_index_array(loaded, [110, 111, 112, 113])
    assert_index_array(core.match([1, 2, 3, 4]).indices, [20, 21, 22, 23])
    host_freed = []
    assert core.evict_host(100, host_freed.append, batch) == 2
    for value in host_freed:
        assert_index_array(value)
    assert sorted(np.concatenate(host_freed).tolist()) == [114, 115]


def test_write_through_hands_numpy_arrays(core_name):
    core = numpy_core(core_name, host_tier=True, hits=1)
    core.insert([1, 2, 3], [7, 8, 9])
    seen = []

    def backup(device):
        seen.append(device)
        return np.arange(50, 50 + len(device), dtype=np.int64)

    assert core.write_through(backup) == 3
    assert_index_array(seen[0], [7, 8, 9])
    assert_index_array(core.match([1, 2, 3]).last_node.host_value, [50, 51, 52])


def _backup_answers():
    base = np.arange(100, 106, dtype=np.int64)
    wide = np.zeros(12, dtype=np.int64)
    wide[::2] = base

    class Sub(np.ndarray):
        pass

    return {
        "exact": (base, None),
        "read-only": (np.frombuffer(base.tobytes(), dtype=np.int64), None),
        "longlong": (base.astype(np.longlong), None),
        "strided": (wide[::2], None),
        "subclass": (base.view(Sub), None),
        "int32": (base.astype(np.int32), TypeError),
        "big-endian": (base.astype(">i8"), TypeError),
        "2-D": (base.reshape(2, 3), ValueError),
        "short": (base[:5], ValueError),
        "list": (base.tolist(), TypeError),
        "tensor": (torch.arange(100, 106) if HAS_TORCH else None, TypeError),
    }


@pytest.mark.parametrize("answer", [
    pytest.param(name, marks=needs_torch) if name == "tensor" else name
    for name in _backup_answers()])
def test_backup_answer_checks(core_name, answer):
    """backup's answer in numpy mode: a 1-D int64 numpy array of the node's length (copied:
    it may change afterwards); anything else raises and leaves the victim as it was."""
    host, error = _backup_answers()[answer]
    core = numpy_core(core_name, host_tier=True)
    core.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    if error is None:
        assert core.evict(6, None, False, None, lambda device: host) == 6
        if isinstance(host, np.ndarray) and host.flags.writeable:
            host[...] = 0  # the core keeps a copy
        assert core.host_size == 6
        assert_index_array(core.match([1, 2, 3, 4, 5, 6]).last_host_node.host_value,
                           range(100, 106))
    else:
        with pytest.raises(error, match="backup"):
            core.evict(6, None, False, None, lambda device: host)
        assert core.host_size == 0 and core.evictable == 6
        assert core.match([1, 2, 3, 4, 5, 6]).indices.tolist() == [10, 11, 12, 13, 14, 15]


@needs_torch
def test_torch_core_refuses_numpy_backup(core_name):
    core = torch_core(core_name, host_tier=True)
    core.insert([1, 2], [10, 11])
    with pytest.raises(TypeError, match="torch.Tensor"):
        core.evict(2, None, False, None, lambda device: np.array([5, 6], dtype=np.int64))
    assert core.evictable == 2


@needs_torch
def test_set_value_and_tensor_inputs(core_name):
    """Tensors and numpy arrays as inputs; results numpy all the same."""
    core = numpy_core(core_name)
    result = core.insert(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]))
    assert result is not None  # this process has bound torch already (the fixtures)
    assert_index_array(core.match(torch.tensor([1, 2, 3])).indices, [4, 5, 6])
    core.set_value(result.last_node, np.array([7, 8, 9], dtype=np.int64))
    assert_index_array(result.last_node.value, [7, 8, 9])


@needs_torch
def test_tensor_declined_before_torch_is_bound(core_name):
    """A tensor given to a numpy-array core before torch is bound in the cores is declined
    (None), changing nothing; once bound (``_torch.is_tensor`` binds it), it is read."""
    module = CORES[core_name].__name__
    out = run_python(f"""
        import {module} as m
        from radixcache import _torch
        core = m.Core(1, "lru", numpy_arrays=True)
        import torch
        tokens = torch.tensor([1, 2, 3])
        print(core.insert(tokens, None), core.match(tokens), core.tree.node_count,
              core.inserts, core.lookups)
        assert _torch.is_tensor(tokens)
        print(core.insert(tokens, None).prefix_len, core.match(tokens).indices.tolist())
    """)
    assert out.splitlines() == ["None None 0 0 0", "0 [1, 2, 3]"]


# -- the same operations give the same values in both modes ------------------------------------
def _plain(value):
    if isinstance(value, torch.Tensor):
        return ("array", value.tolist())
    if isinstance(value, np.ndarray):
        assert_index_array(value)
        return ("array", value.tolist())
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
        except Exception as exc:  # compared across modes
            # Node ids come from one counter per core module: they differ between the two.
            out = ("raised", type(exc).__name__, re.sub(r"\d+", "#", str(exc)))
        return out, log


KINDS = ["insert"] * 4 + ["match"] * 3 + ["evict"] * 2 + ["evict_host", "write_through",
                                                          "load_back", "lock", "unlock"]


@pytest.mark.parametrize("host_tier,hits", [(False, 0), (True, 0), (True, 1)])
@pytest.mark.parametrize("seed", range(4))
@needs_torch
def test_both_modes_give_the_same_values(core_name, host_tier, hits, seed):
    page_size = 1 + seed % 2
    arrays = Driver(numpy_core(core_name, page_size, "lru", host_tier, hits), True)
    tensors = Driver(torch_core(core_name, page_size, "lru", host_tier, hits), False)
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


@needs_torch
def test_state_round_trip(core_name):
    source = torch_core(core_name)
    source.insert([1, 2, 3], [7, 8, 9])
    source.insert([1, 2, 4], None)
    state = source.export_state()
    core = numpy_core(core_name)
    core.import_state(state)
    assert_index_array(core.match([1, 2, 3]).indices, [7, 8, 9])
    assert_index_array(core.match([1, 2, 4]).indices, [7, 8, 4])  # the prefix keeps its values
    again = numpy_core(core_name)
    again.import_state(core.export_state())
    assert_index_array(again.match([1, 2, 3]).indices, [7, 8, 9])


@needs_torch
def test_state_with_device_values_refused(core_name):
    """A numpy-array core holds CPU values only: a state carrying device tensors (here on
    torch's meta device) is refused, before any change."""
    source = torch_core(core_name)
    source.insert([1, 2, 3], [7, 8, 9])
    state = source.export_state()
    records = list(state["nodes"])
    record = list(records[0])
    record[2] = torch.empty(3, dtype=torch.int64, device="meta")
    records[0] = tuple(record)
    state["nodes"] = records
    core = numpy_core(core_name)
    with pytest.raises(ValueError, match="bad tree state: .*numpy arrays holds CPU values only"):
        core.import_state(state)
    assert core.tree.node_count == 0 and core.evictable == 0
    assert core.match([1, 2, 3]).length == 0
    assert _state.check_state(state, 1)  # (the state itself is well formed)


def test_the_tensor_stand_in_has_no_instances(core_name):
    """Until torch is bound a core's tensor type is a stand-in that nothing may be an
    instance of: one given as tokens or values would reach torch's (unbound) names."""
    stand_in = CORES[core_name]._NoTensor
    with pytest.raises(TypeError, match="no instances"):
        stand_in()
    with pytest.raises(TypeError):
        stand_in.__new__(stand_in)
