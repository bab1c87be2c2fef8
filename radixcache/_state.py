"""A tree's content as both cores must agree on it: the state that copies and pickles carry
(``Core.export_state``/``import_state``: ``NODE_FIELDS``, ``COUNTER_FIELDS``, ``check_state``,
``id_order``) and the order in which siblings are listed (``display_order``)."""

from __future__ import annotations

from ._torch import is_tensor, loaded_torch
from ._validate import INT64_MAX, INT64_MIN

__all__ = ["NODE_FIELDS", "COUNTER_FIELDS", "check_state", "id_order", "display_order"]

#: The fields of one node in ``Core.export_state()["nodes"]``, in order.
NODE_FIELDS = ("parent", "key", "value", "extra_key", "priority", "last_access_time",
               "created_time", "hit_count", "terminal", "id")
#: The counters ``Core.export_state()["counters"]`` holds, in order.
COUNTER_FIELDS = ("lookups", "matched_tokens", "queried_tokens", "inserts", "inserted_tokens",
                  "evictions", "evicted_tokens")


def _state_int(value, what: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value <= INT64_MAX:
        raise ValueError(f"bad tree state: {what} must be an int in [{low}, 2^63), got "
                         f"{value!r}")
    return value


def check_state(state, page_size: int, numpy_arrays: bool = False) -> dict:
    """Validate a tree state (``Core.export_state()``'s dict) for a core of ``page_size``;
    returns a copy of what passed, its node records with CPU values as int64 bytes (user
    code, such as an extra_key's ``__hash__``, may change ``state`` once read: a core
    imports the copy). A core of ``numpy_arrays`` holds CPU values only: a device tensor is
    refused. Raises ValueError naming the first problem. Nothing here touches a tree."""
    if not isinstance(state, dict):
        raise ValueError(f"bad tree state: expected a dict, got {type(state).__name__}")
    try:
        records = state["nodes"]
        clock = _state_int(state["clock"], "clock")
        num_splits = _state_int(state["num_splits"], "num_splits")
        counters = state["counters"]
        empty_inserted = state["empty_inserted"]
    except KeyError as exc:
        raise ValueError(f"bad tree state: no {exc.args[0]!r}") from None
    if not isinstance(records, list) or not isinstance(empty_inserted, list):
        raise ValueError("bad tree state: 'nodes' and 'empty_inserted' must be lists")
    if not isinstance(counters, (list, tuple)) or len(counters) != len(COUNTER_FIELDS):
        raise ValueError(f"bad tree state: 'counters' must hold {len(COUNTER_FIELDS)} ints")
    counters, empty_inserted = tuple(counters), list(empty_inserted)
    for name, value in zip(COUNTER_FIELDS, counters):
        _state_int(value, name)
    page_bytes = 8 * page_size
    out = []
    firsts: set = set()
    ids: set = set()
    for i, record in enumerate(records):
        if not isinstance(record, tuple) or len(record) != len(NODE_FIELDS):
            raise ValueError(f"bad tree state: node {i} is not a tuple of "
                             f"{len(NODE_FIELDS)} fields")
        parent, key, value, extra_key, priority, last, created, hits, terminal, old_id = record
        if type(parent) is not int or not -1 <= parent < i:
            raise ValueError(f"bad tree state: node {i} has parent {parent!r} (a node listed "
                             "before it, or -1 for the root)")
        if type(key) is not bytes or not key or len(key) % page_bytes:
            raise ValueError(f"bad tree state: node {i}'s key must be a non-empty bytes of "
                             f"whole pages ({page_bytes} bytes each)")
        if value is not None:
            if is_tensor(value):
                if value.dim() != 1 or value.dtype != loaded_torch().int64:
                    raise ValueError(f"bad tree state: node {i}'s value must be a 1-D int64 "
                                     "tensor")
                if value.device.type == "cpu":
                    value = value.numpy().tobytes()
                elif numpy_arrays:
                    raise ValueError(f"bad tree state: node {i}'s value is a device tensor: a "
                                     "cache with numpy arrays holds CPU values only")
                elif value.shape[0] * 8 != len(key):
                    raise ValueError(f"bad tree state: node {i} has {value.shape[0]} values "
                                     f"for {len(key) // 8} tokens")
            if type(value) is bytes:
                if len(value) != len(key):
                    raise ValueError(f"bad tree state: node {i} has {len(value) // 8} values "
                                     f"for {len(key) // 8} tokens")
            elif not is_tensor(value):
                raise ValueError(f"bad tree state: node {i}'s value must be None, bytes or a "
                                 f"tensor, got {type(value).__name__}")
        if parent != -1:
            extra_key = None  # below the root a node is in its parent's namespace
        elif extra_key is not None:
            hash(extra_key)  # TypeError for an unhashable one, before any tree change
        if type(priority) is not int or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"bad tree state: node {i}'s priority must be an int64")
        _state_int(last, f"node {i}'s last_access_time")
        _state_int(created, f"node {i}'s created_time")
        _state_int(hits, f"node {i}'s hit_count")
        _state_int(old_id, f"node {i}'s id")
        if type(terminal) is not bool:
            raise ValueError(f"bad tree state: node {i}'s terminal must be a bool")
        first = (parent, extra_key, key[:page_bytes])
        if first in firsts:
            raise ValueError(f"bad tree state: node {i} starts with the same page as a "
                             "sibling")
        if old_id in ids:
            raise ValueError(f"bad tree state: node id {old_id} appears twice")
        firsts.add(first)
        ids.add(old_id)
        out.append((parent, key, value, extra_key, priority, last, created, hits, terminal,
                    old_id))
    return {"nodes": out, "clock": clock, "num_splits": num_splits,
            "empty_inserted": empty_inserted, "counters": counters}


def id_order(records: list) -> list:
    """Positions of ``records`` sorted by their saved ids: an import hands its new nodes
    fresh ids in this order, so ties in eviction order break as they did when saved."""
    return sorted(range(len(records)), key=lambda i: records[i][9])


def display_order(node) -> tuple:
    """Sort key for listing siblings: namespace, then tokens (the same on both cores)."""
    extra_key = node.extra_key
    return (extra_key is not None, repr(extra_key), node.key[:16].tolist())
