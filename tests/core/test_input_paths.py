"""Every input path of the whole-call core interface, on both cores.

The cores take the common inputs whole (tokens as list/tuple of ints, int64 numpy array,
``array('q')``, CPU int64 tensor; kv_indices as such a tensor/array or a sequence) and decline
the rest to cache.py's validation. Each test runs once per core (``make_cache``); each input
kind must give exactly the result a plain list gives, and bad input must raise the same
exception with nothing changed, whichever path it took.
"""

from __future__ import annotations

import array
import io

import numpy as np
import pytest
import torch

from radixcache import RadixCache
from radixcache._core import CORES
from conftest import check_invariants, core_of

SEQ = [3, 1, 4, 1, 5, 9, 2, 6]
BIG = [2**40 + 7, -(2**40), 2**62, 2**63 - 1, -(2**63), 0, -1, 2**30, 2**60, -(2**60) - 1,
       2**63 - 2**30]


class IndexInt:
    """Not an int, but has __index__: declined by the fast path, accepted by validation."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


class SubInt(int):
    pass


# Each maker turns a list of ints into one kind of token input.
TOKEN_KINDS = {
    "list": list,
    "tuple": tuple,
    "numpy": lambda s: np.array(s, dtype=np.int64),
    "array_q": lambda s: array.array("q", s),
    "tensor": lambda s: torch.tensor(s, dtype=torch.int64),
    # Declined by the fast path (the Python path converts them):
    "numpy_int32": lambda s: np.array(s, dtype=np.int32),
    "numpy_uint16": lambda s: np.array(s, dtype=np.uint16),
    "numpy_strided": lambda s: np.repeat(np.array(s, dtype=np.int64), 2)[::2],
    "numpy_big_endian": lambda s: np.array(s, dtype=">i8"),
    "numpy_readonly": lambda s: np.frombuffer(np.array(s, dtype=np.int64).tobytes(),
                                              dtype=np.int64),
    "array_i": lambda s: array.array("i", s),
    "tensor_int32": lambda s: torch.tensor(s, dtype=torch.int32),
    "tensor_strided": lambda s: torch.tensor(s, dtype=torch.int64).repeat_interleave(2)[::2],
    "tensor_view": lambda s: torch.tensor([0] + s, dtype=torch.int64)[1:],
    "list_of_numpy_ints": lambda s: [np.int64(t) for t in s],
    "list_of_index_objects": lambda s: [IndexInt(t) for t in s],
    "list_of_int_subclass": lambda s: [SubInt(t) for t in s],
    "generator_list": lambda s: list(t for t in s),
}

SMALL_KINDS = ["numpy_uint16", "array_i", "tensor_int32", "numpy_int32"]  # cannot hold BIG values


def _kind_ok(kind: str, values: list) -> bool:
    return not (kind in SMALL_KINDS and any(not 0 <= v < 2**15 for v in values))


@pytest.mark.parametrize("kind", list(TOKEN_KINDS))
@pytest.mark.parametrize("page_size", [1, 2])
def test_token_kinds_give_the_list_result(make_cache, kind, page_size):
    make = TOKEN_KINDS[kind]
    for values in (SEQ, BIG):
        if not _kind_ok(kind, values):
            continue
        reference = make_cache(page_size=page_size)
        cache = make_cache(page_size=page_size)
        kv = list(range(100, 100 + len(values)))
        expected = reference.insert(values, kv)
        got = cache.insert(make(values), kv)
        assert got.prefix_len == expected.prefix_len
        assert cache.exists(make(values)) == reference.exists(values)
        aligned = len(values) - len(values) % page_size
        assert cache.exists(make(values[:aligned])) == reference.exists(values[:aligned])
        for probe in (values, values[:5], values[:3] + [77, 78, 79]):
            want = reference.match_prefix(probe)
            have = cache.match_prefix(make(probe))
            assert have.length == want.length
            assert have.indices.tolist() == want.indices.tolist()
            assert have.indices.dtype == torch.int64
        assert cache.stats() == reference.stats()
        out_ref, out = io.StringIO(), io.StringIO()
        reference.pretty_print(out_ref)
        cache.pretty_print(out)
        assert out.getvalue() == out_ref.getvalue()
        check_invariants(cache)


# kv inputs: the token makers that suit values (the last four declined by the fast path).
KV_KINDS = {name: TOKEN_KINDS[name] for name in (
    "list", "tuple", "numpy", "array_q", "tensor",
    "numpy_int32", "numpy_strided", "tensor_int32", "tensor_strided")}
KV_KINDS["array_l"] = lambda s: array.array("l", s)


@pytest.mark.parametrize("kind", list(KV_KINDS))
def test_kv_kinds_store_the_same_values(make_cache, kind):
    make = KV_KINDS[kind]
    cache = make_cache(page_size=2)
    first = [10, 11, 12, 13, 14, 15]
    cache.insert(SEQ[:6], make(first))
    # A second insert sharing 4 tokens: only the last 4 of its kv are stored.
    second = [20, 21, 22, 23, 24, 25, 26, 27, 28]   # one more than the aligned length
    result = cache.insert(SEQ[:4] + [7, 7, 8, 8, 9], make(second))
    assert result.prefix_len == 4
    assert cache.match_prefix(SEQ[:6]).indices.tolist() == first
    assert cache.match_prefix(SEQ[:4] + [7, 7, 8, 8]).indices.tolist() == [10, 11, 12, 13,
                                                                          24, 25, 26, 27]
    check_invariants(cache)


def test_stored_values_are_copies(make_cache):
    cache = make_cache()
    tokens = np.array(SEQ, dtype=np.int64)
    kv = torch.arange(100, 108)
    cache.insert(tokens, kv)
    tokens[:] = 0
    kv[:] = -1
    match = cache.match_prefix(SEQ)
    assert match.length == 8 and match.indices.tolist() == list(range(100, 108))
    match.indices[:] = 5  # the returned tensor is the caller's: the cache keeps its own
    assert cache.match_prefix(SEQ).indices.tolist() == list(range(100, 108))
    assert cache.exists(SEQ)


@pytest.mark.parametrize("method", ["insert", "match_prefix", "exists"])
@pytest.mark.parametrize("bad, exc, message", [
    ([1, 2, 2**63], OverflowError, "token id 9223372036854775808 does not fit in int64"),
    ([1, -(2**63) - 1], OverflowError, "does not fit in int64"),
    ([1, 2.5], TypeError, "token ids must be integers, got float"),
    ((1, "x"), TypeError, "token ids must be integers, got str"),
    ([IndexInt(1), IndexInt(2**64)], OverflowError, "does not fit in int64"),
    (np.array([1.0]), TypeError, "must hold integers"),
    (np.arange(4, dtype=np.int64).reshape(2, 2), ValueError, "1-D"),
    (torch.tensor([1.5]), TypeError, "must hold integers"),
    (torch.arange(4).reshape(2, 2), ValueError, "1-D"),
    (torch.arange(4, device="meta"), ValueError, "CPU tensor"),
    (array.array("d", [1.0]), TypeError, "typecode"),
])
def test_bad_tokens_raise_the_same_error_on_every_core(make_cache, method, bad, exc, message):
    cache = make_cache()
    cache.insert(SEQ, list(range(8)))
    before = (cache.stats(), cache.node_count(), cache.total_size())
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
        getattr(cache, method)(bad)
    assert (cache.stats(), cache.node_count(), cache.total_size()) == before
    check_invariants(cache)


@pytest.mark.parametrize("bad, exc", [
    (torch.arange(7), ValueError),                        # too short
    (np.arange(7, dtype=np.int64), ValueError),
    (array.array("q", range(7)), ValueError),
    ([1] * 7, ValueError),
    ([1.5] * 8, TypeError),
    ([1] * 7 + [2**63], (TypeError, OverflowError)),   # numpy makes it float64
    ([IndexInt(1)] * 7 + [None], TypeError),            # numpy makes it an object array
    (torch.ones(8, dtype=torch.bool), TypeError),
    (torch.arange(8, dtype=torch.float32), TypeError),
    (np.zeros((8, 1), dtype=np.int64), ValueError),
])
def test_bad_kv_changes_nothing(make_cache, bad, exc):
    cache = make_cache()
    cache.insert(SEQ[:4] + [0, 0], list(range(6)))   # [1,2,3..] shares 4 tokens with SEQ
    before = (cache.stats(), cache.node_count(), cache.total_size())
    with pytest.raises(exc):
        cache.insert(SEQ, bad)    # would split the first node if it got that far
    assert (cache.stats(), cache.node_count(), cache.total_size()) == before
    assert not cache.exists(SEQ)
    check_invariants(cache)


def test_kv_list_of_index_objects_is_accepted(make_cache):
    cache = make_cache()
    cache.insert(SEQ, [IndexInt(100 + i) for i in range(len(SEQ))])
    assert cache.match_prefix(SEQ).indices.tolist() == list(range(100, 100 + len(SEQ)))


@pytest.mark.parametrize("priority, exc", [(2**63, OverflowError), (1.5, TypeError),
                                           ("1", TypeError)])
def test_bad_priority_changes_nothing(make_cache, priority, exc):
    cache = make_cache()
    cache.insert(SEQ[:4])
    before = (cache.stats(), cache.node_count())
    with pytest.raises(exc, match="priority"):
        cache.insert(SEQ, priority=priority)
    assert (cache.stats(), cache.node_count()) == before


def test_priority_kinds_accepted(make_cache):
    cache = make_cache(eviction_policy="priority")
    cache.insert([1, 2], priority=np.int64(5))
    cache.insert([3, 4], priority=SubInt(3))
    cache.insert([5, 6], priority=-(2**63))
    with pytest.raises(TypeError, match="priority"):
        cache.insert([7, 8], priority=True)    # a bool is refused, as before
    priorities = sorted(node.priority for node, depth in core_of(cache).tree.iter_nodes() if depth)
    assert priorities == [-(2**63), 3, 5]


def test_unhashable_extra_key(make_cache):
    cache = make_cache()
    for method in ("insert", "match_prefix", "exists"):
        with pytest.raises(TypeError, match="extra_key must be hashable"):
            getattr(cache, method)(SEQ, extra_key=[1])
    assert cache.node_count() == 0 and cache.stats().lookups == 0


def test_new_and_known_namespaces(make_cache):
    cache = make_cache()
    for key in ("a", ("t", 1), 7, None):
        assert cache.insert(np.array(SEQ), torch.arange(8), extra_key=key).prefix_len == 0
        assert cache.insert(torch.tensor(SEQ), extra_key=key).prefix_len == 8
        assert cache.match_prefix(array.array("q", SEQ), extra_key=key).length == 8
        assert cache.exists(tuple(SEQ), extra_key=key)
    assert not cache.exists(SEQ, extra_key="unknown")
    assert cache.match_prefix(SEQ, extra_key="unknown").length == 0
    assert cache.node_count() == 4


def test_empty_inputs_of_every_kind(make_cache):
    cache = make_cache()
    for make in (list, tuple, lambda s: np.array(s, dtype=np.int64),
                 lambda s: array.array("q", s), lambda s: torch.tensor(s, dtype=torch.int64)):
        assert cache.insert(make([])).prefix_len == 0
        assert cache.exists(make([]))
        assert cache.match_prefix(make([])).length == 0
    assert cache.stats().inserts == 5 and cache.stats().lookups == 5


def test_torch_function_mode_takes_the_python_path(make_cache):
    from torch.overrides import TorchFunctionMode

    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    cache = make_cache()
    with Watch():
        cache.insert(torch.tensor(SEQ), torch.arange(8))
        match = cache.match_prefix(torch.tensor(SEQ[:4]))
    assert match.length == 4 and match.indices.tolist() == [0, 1, 2, 3]
    assert seen  # the tensors were read through torch (the hooks saw it), not around it


def test_device_values_stay_on_their_device(make_cache):
    cache = make_cache()
    cache.insert(SEQ, torch.arange(8, device="meta"))
    cache.insert(SEQ[:4] + [0, 0], torch.arange(6))   # splits a node holding device values
    match = cache.match_prefix(torch.tensor(SEQ))
    assert match.length == 8 and match.indices.device.type == "meta"
    assert cache.match_prefix(SEQ[:4] + [0, 0]).indices.device.type == "meta"
    check_invariants(cache)


@pytest.mark.parametrize("change", [lambda t: t.resize_(2), lambda t: t.set_(torch.empty(
    0, dtype=torch.int64, device="meta")), lambda t: t.unsqueeze_(0)],
    ids=["resize_", "set_", "unsqueeze_"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_a_handed_out_device_value_keeps_the_tree_as_it_was(make_cache, change, split):
    # A node's device value is handed out as kept (its data is the node's), but as a new
    # view: changing the shape of what the caller got must not change what the tree reads.
    cache = make_cache()
    cache.insert(SEQ, torch.arange(100, 108, device="meta"))
    node = cache.match_prefix(SEQ).last_node
    if split:
        cache.match_prefix(SEQ[:4] + [99])  # halves share the tensor: the lower half keeps node
    handed = [node.value, node.stored_value]
    for value in handed:
        assert value.device.type == "meta" and value.shape == (node.num_tokens,)
        change(value)
    match = cache.match_prefix(SEQ)
    assert match.length == 8 and match.indices.shape == (8,)
    assert [n.value.shape[0] for n in (match.last_node, match.last_node.parent)
            if n.parent is not None] == ([4, 4] if split else [8])
    freed = []
    assert cache.evict(100, freed.append) == 8
    assert [t.shape[0] for t in freed] == ([4, 4] if split else [8])
    check_invariants(cache)


@pytest.mark.parametrize("change", [lambda t: t.resize_(2), lambda t: t.unsqueeze_(0)],
                         ids=["resize_", "unsqueeze_"])
def test_a_backup_changing_its_device_tensor_leaves_the_node_as_it_was(make_cache, change):
    # backup gets a victim's device indices while the victim is still in the tree: a node
    # with host-only children that gets no host copy stays on the device, values intact.
    cache = make_cache(host_tier=True)
    cache.insert(SEQ, torch.arange(100, 108, device="meta"))
    cache.insert(SEQ + [9, 9], torch.arange(100, 110, device="meta"))
    assert cache.evict(2, backup=lambda device: torch.arange(50, 50 + len(device))) == 2
    seen = []

    def backup(device):
        seen.append(device.shape[0])
        change(device)
        return None  # the host is full

    assert cache.evict(100, backup=backup) == 0
    assert seen == [8]
    match = cache.match_prefix(SEQ + [9, 9])
    assert match.length == 8 and match.indices.shape == (8,) and match.host_length == 2
    assert match.last_node.value.shape == (8,)
    check_invariants(cache)


@pytest.mark.parametrize("method", ["insert", "match_prefix", "exists"])
@pytest.mark.parametrize("tokens", [SEQ, np.array(SEQ), torch.tensor(SEQ),
                                    [IndexInt(t) for t in SEQ]],
                         ids=["list", "numpy", "tensor", "index-objects"])
def test_nested_call_from_extra_key_hash_raises_on_every_path(make_cache, method, tokens):
    # Fast path or validation path: a call from inside a call is refused, nothing changes.
    cache = make_cache()
    cache.insert(SEQ)
    nested = []

    class Key:
        def __hash__(self):
            try:
                cache.match_prefix(SEQ)
            except RuntimeError as exc:
                nested.append(str(exc))
            return 1

        def __eq__(self, other):
            return isinstance(other, Key)

    before = (cache.stats(), cache.node_count())
    getattr(cache, method)(tokens, extra_key=Key())
    assert nested and all("re-entered" in msg for msg in nested)
    if method == "exists":
        assert (cache.stats(), cache.node_count()) == before
    check_invariants(cache)


@pytest.mark.skipif(len(CORES) < 2, reason="only one tree core is available")
def test_both_cores_agree_on_a_mixed_stream():
    rng = np.random.default_rng(7)
    makers = [TOKEN_KINDS[k] for k in ("list", "tuple", "numpy", "array_q", "tensor",
                                       "numpy_int32", "tensor_strided", "list_of_index_objects")]
    caches = {name: RadixCache(page_size=2, core=name) for name in CORES}
    base = rng.integers(0, 50, size=40).tolist()
    for step in range(300):
        head = base[: int(rng.integers(0, 40))]
        seq = head + rng.integers(0, 50, size=int(rng.integers(0, 6))).tolist()
        make = makers[step % len(makers)]
        op = int(rng.integers(3))
        outcomes = []
        for cache in caches.values():
            if op == 0:
                kv = torch.arange(1000 + step, 1000 + step + len(seq))
                r = cache.insert(make(seq), kv)
                outcomes.append((r.prefix_len, r.last_node.num_tokens))
            elif op == 1:
                r = cache.match_prefix(make(seq))
                outcomes.append((r.length, r.indices.tolist()))
            else:
                outcomes.append(cache.exists(make(seq)))
            if step % 50 == 49:
                cache.evict(30)
        assert all(o == outcomes[0] for o in outcomes), (step, outcomes)
    stats = [c.stats() for c in caches.values()]
    assert all(s == stats[0] for s in stats)


EDGE_INTS = [0, 1, -1, True, False, SubInt(5), IndexInt(-7), 2**30 - 1, 2**30, -(2**30),
             2**60 - 1, 2**60, -(2**60), 2**62, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1,
             2**64, -(2**64), 2**90 - 1, 2**90, 2**100]


def _outcome(call):
    try:
        result = call()
    except Exception as exc:  # the same type and message on every core
        return (type(exc).__name__, str(exc))
    if hasattr(result, "indices"):
        return (result.length, result.indices.tolist())
    return getattr(result, "prefix_len", result)


@pytest.mark.skipif(len(CORES) < 2, reason="only one tree core is available")
def test_both_cores_read_edge_ints_in_lists_alike():
    # Every pair of edge values, as a list and a tuple: the compiled reader's digit paths
    # (one to three 30-bit digits, signs, bools, subclasses, __index__) against the pure
    # core's, with the same answer or the same error.
    caches = {name: RadixCache(core=name) for name in CORES}
    for i, first in enumerate(EDGE_INTS):
        for second in EDGE_INTS[i:]:
            for make in (list, tuple):
                seq = make([7, first, second])
                outcomes = [(_outcome(lambda: cache.insert(seq)),  # noqa: B023 -- run now
                             _outcome(lambda: cache.match_prefix(seq)),  # noqa: B023 -- run now
                             _outcome(lambda: cache.exists(seq)))  # noqa: B023 -- run now
                            for cache in caches.values()]
                assert all(o == outcomes[0] for o in outcomes), (first, second, outcomes)
    assert len({repr(c.stats()) for c in caches.values()}) == 1
    for cache in caches.values():
        check_invariants(cache)
    # bools read as 0 and 1, as Python's int(True) does
    assert caches["python"].exists([7, 1, 0]) and caches["python"].exists([7, True, False])


@pytest.mark.parametrize("make", [list, tuple, lambda s: [IndexInt(t) for t in s],
                                  lambda s: np.array(s, dtype=np.int32)],
                         ids=["list", "tuple", "index-objects", "numpy-int32"])
def test_device_kv_with_every_token_kind(make_cache, make):
    # Device values always take the validation path; its tokens come out the same.
    cache = make_cache(page_size=2)
    result = cache.insert(make(SEQ), torch.arange(8, device="meta"))
    assert result.prefix_len == 0
    assert cache.insert(make(SEQ[:4] + [0, 0]), torch.arange(6, device="meta")).prefix_len == 4
    match = cache.match_prefix(SEQ)
    assert match.length == 8 and match.indices.device.type == "meta"
    assert cache.exists(SEQ) and cache.exists(SEQ[:4] + [0, 0])
    with pytest.raises(TypeError, match="token ids must be integers"):
        cache.insert([3, 1, 4, 1.5], torch.arange(4, device="meta"))
    check_invariants(cache)


# A CPU int64 tensor with the negative bit set (torch._neg_view, what some lazy negations
# return) holds its values un-negated in memory: reading its data pointer would see the wrong
# sign. Both cores must treat it alike (torch refuses .numpy() on it: RuntimeError).
@pytest.mark.parametrize("method", ["match_prefix", "exists", "insert"])
def test_negative_bit_tokens_are_not_read_raw(make_cache, method):
    cache = make_cache()
    cache.insert(SEQ, list(range(8)))
    before = (cache.stats(), cache.node_count(), cache.total_size())
    tokens = torch._neg_view(torch.tensor([-t for t in SEQ]))
    assert tokens.is_neg() and tokens.tolist() == SEQ
    with pytest.raises(RuntimeError, match="negative bit"):
        getattr(cache, method)(tokens)
    assert (cache.stats(), cache.node_count(), cache.total_size()) == before
    check_invariants(cache)


def test_negative_bit_kv_indices_are_not_read_raw(make_cache):
    cache = make_cache()
    kv = torch._neg_view(torch.arange(0, -8, -1))
    assert kv.is_neg() and kv.tolist() == list(range(8))
    with pytest.raises(RuntimeError, match="negative bit"):
        cache.insert(SEQ, kv)
    assert cache.node_count() == 0 and cache.match_prefix(SEQ).length == 0
    check_invariants(cache)


# The index tensor of a miss is the caller's like any other: changing it in place (set_,
# unsqueeze_, as_strided_ change a tensor's metadata, not its data) must not show up in the
# result of a later miss, on this cache or another one.
@pytest.mark.parametrize("change", [
    lambda t: t.set_(torch.arange(3)),
    lambda t: t.set_(torch.arange(5)).resize_(2),
    lambda t: t.unsqueeze_(0),
    lambda t: t.as_strided_((0, 4), (4, 1)),
], ids=["set_", "set_resize_", "unsqueeze_", "as_strided_"])
@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_changing_a_miss_result_in_place_changes_no_later_result(make_cache, change, closed):
    cache, other = make_cache(page_size=2), make_cache()
    cache.insert(SEQ)
    for miss in (cache.match_prefix([99, 98]), cache.match_prefix([5]),
                 other.match_prefix([42])):
        if closed:
            miss.close()
        change(miss.indices)
        for later in (cache.match_prefix([99, 98]), cache.match_prefix([3]),
                      cache.match_prefix([]), other.match_prefix([43])):
            assert later.length == 0
            assert later.indices.shape == (0,) and later.indices.dtype == torch.int64
    assert cache.match_prefix(SEQ).indices.tolist() == SEQ
    check_invariants(cache)


# Around every boundary of an int's digits (30-bit digits: 1, 2 and 3 of them) and of int64.
_EDGES = sorted({s * (2**b + d) for b in (0, 29, 30, 31, 40, 59, 60, 61, 62, 63, 64, 89, 90)
                 for d in (-1, 0, 1) for s in (1, -1)}
                | {7 * 2**60, 8 * 2**60, -8 * 2**60, 15 * 2**60, 16 * 2**60, 0})


@pytest.mark.parametrize("kind", [list, tuple])
def test_int_reader_at_digit_and_int64_edges(core_name, kind):
    """The fast list reader takes exactly the ints in int64 (read exactly) and declines the
    rest, whatever their size and sign; lists mixing sizes and signs read alike."""
    core = CORES[core_name].Core(1, "lru")
    for value in _EDGES:
        got = core.token_array(kind([value]))
        if -(2**63) <= value < 2**63:
            assert got is not None and got.tolist() == [value], value
        else:
            assert got is None, value
    fits = [v for v in _EDGES if -(2**63) <= v < 2**63]
    mixed = [fits[(i * 7919) % len(fits)] for i in range(3 * len(fits))]
    assert core.token_array(kind(mixed)).tolist() == mixed
    assert core.token_array(kind(mixed + [2**63])) is None
    cache = RadixCache(core=core_name)
    cache.insert(kind(mixed), kind(range(len(mixed))))
    assert cache.match_prefix(np.array(mixed, dtype=np.int64)).length == len(mixed)
    assert cache.exists(kind(mixed))
