"""The block hash of ``radixcache.events``, re-implemented from its documented definition
(struct + hashlib), not from the module's own functions, and checks of events against a tree."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any, List, Optional

import pytest

import radixcache.events as ev
from radixcache import RadixCache
from radixcache._core import CORES
from conftest import core_of

try:
    import msgspec
    import zmq
except ImportError:  # the transport is optional; its tests skip
    msgspec = zmq = None

REPO_ROOT = Path(__file__).resolve().parents[2]
needs_transport = pytest.mark.skipif(msgspec is None, reason="pyzmq/msgspec not installed")
CORE_NAMES = sorted(CORES)
SOCKET_WAIT_S = 10.0  # upper bound on any one wait for a socket; tests finish far sooner


def ref_namespace(extra_key: Any) -> bytes:
    if extra_key is None:
        return b"N"
    if isinstance(extra_key, str):
        data = extra_key.encode("utf-8")
        return b"S" + struct.pack(">Q", len(data)) + data
    if isinstance(extra_key, bytes):
        return b"B" + struct.pack(">Q", len(extra_key)) + extra_key
    data = b"%d" % int(extra_key)
    return b"I" + struct.pack(">Q", len(data)) + data


def ref_hash(parent: Optional[int], tokens: List[int], extra_key: Any = None) -> int:
    head = b"\x00" if parent is None else b"\x01" + struct.pack(">q", parent)
    body = struct.pack(f"<{len(tokens)}q", *tokens)
    digest = hashlib.sha256(head + ref_namespace(extra_key) + body).digest()
    return struct.unpack(">q", digest[:8])[0]


def ref_chain(parent: Optional[int], tokens: List[int], extra_key: Any, page: int) -> list:
    hashes = []
    for start in range(0, len(tokens) - len(tokens) % page, page):
        parent = ref_hash(parent, list(tokens[start:start + page]), extra_key)
        hashes.append(parent)
    return hashes


def stored(parent: Optional[int], tokens: List[int], extra_key: Any, page: int):
    """The BlockStored the recorder emits by default: medium "GPU", the namespace per block."""
    hashes = tuple(ref_chain(parent, tokens, extra_key, page))
    entry = None if extra_key is None else (extra_key,)
    return ev.BlockStored(hashes, parent, tuple(tokens), page, None, "GPU", None,
                          (entry,) * len(hashes))


def tree_pages(cache: RadixCache) -> set:
    """The hashes of every full page in the tree, from a walk of its nodes."""
    last_hash = {}
    pages = set()
    for node, depth in core_of(cache).tree.iter_nodes():
        if depth == 0:
            last_hash[node.id] = None
            continue
        chain = ref_chain(last_hash[node.parent.id], node.key.tolist(), node.extra_key,
                          cache.page_size)
        assert chain, "a node without a full page"
        last_hash[node.id] = chain[-1]
        pages.update(chain)
    return pages


def replay_into(pages: set, events: list, page_size: int) -> None:
    """Apply events to a set of block hashes, checking each is consistent with the set."""
    for event in events:
        if isinstance(event, ev.BlockStored):
            assert len(event.token_ids) == page_size * len(event.block_hashes)
            assert event.block_size == page_size
            assert event.parent_block_hash is None or event.parent_block_hash in pages
            for h in event.block_hashes:
                assert h not in pages, "page stored twice"
                pages.add(h)
        elif isinstance(event, ev.BlockRemoved):
            for h in event.block_hashes:
                assert h in pages, "page removed that was never stored"
                pages.remove(h)
        else:
            assert isinstance(event, ev.AllBlocksCleared)
            pages.clear()
