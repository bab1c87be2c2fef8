"""The KV events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), the media that
name where blocks live and the wire encodings each event lays itself out in.

The bottom of ``radixcache.events``: it imports nothing of radixcache. Its annotations are
evaluated (no ``from __future__ import annotations``): the classes name ``radixcache.events``
as their module, where ``typing.get_type_hints`` could not resolve them by name.
"""

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

# vLLM's names for where a block lives (``vllm.distributed.kv_events.MEDIUM_*``).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

# How events are laid out inside a batch (see ``radixcache.events``): each event lays
# itself out (``to_wire``), so the names live with the events.
ENCODINGS = ("map", "positional")
DEFAULT_ENCODING = "map"


def _check_encoding(encoding: Any) -> str:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
    return encoding


@dataclass(frozen=True)
class BlockStored:
    """Pages that entered the cache: one event per new leaf, its pages in order.

    Attributes:
        block_hashes: The hash of each page (ints; a decoded vLLM event may carry bytes).
        parent_block_hash: The hash of the page before the first one (None at the root).
        token_ids: The tokens of all the pages, in order.
        block_size: Tokens per page.
        lora_id: The LoRA adapter id, or None.
        medium: Where the blocks live (``MEDIUM_GPU`` by default), or None.
        lora_name: The LoRA adapter name, or None.
        extra_keys: One entry per block (a tuple, or None); radixcache puts
            ``(namespace,)`` on every block of a namespaced leaf (see ``extra_keys_entry``).
        group_idx: The KV-cache group (None: radixcache has one).
        cache_salt: The salt of the request that stored the blocks (SGLang's field; its
            hashes already depend on it), or None. Sent in the map encoding only: the
            positional one refuses an event that has one.
    """

    block_hashes: Tuple[Union[int, bytes], ...]
    parent_block_hash: Optional[Union[int, bytes]]
    token_ids: Tuple[int, ...]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    extra_keys: Optional[Tuple[Optional[tuple], ...]] = None
    group_idx: Optional[int] = None
    cache_salt: Optional[str] = None

    def to_wire(self, encoding: str = DEFAULT_ENCODING) -> Union[dict, list]:
        """This event as msgpack-ready data (see the wire format in ``radixcache.events``).

        Args:
            encoding: ``"map"`` (vLLM's tagged maps, the default) or ``"positional"``
                (tagged arrays, for older consumers).

        Returns:
            A dict (map) or a list (positional).

        Raises:
            ValueError: an unknown ``encoding``, or a ``cache_salt`` in the positional one
                (it has no place for it: dropping it would put the blocks in another
                namespace).
        """
        if _check_encoding(encoding) == "positional":
            if self.cache_salt is not None:
                raise ValueError("BlockStored.cache_salt has no place in the positional "
                                 "encoding: use the map encoding")
            wire = ["BlockStored", list(self.block_hashes), self.parent_block_hash,
                    list(self.token_ids), self.block_size, self.lora_id, self.medium]
            extra_keys = self.extra_keys
            if extra_keys is not None and all(entry is None for entry in extra_keys):
                extra_keys = None  # no namespace on any block: nothing to carry
            if self.lora_name is not None or extra_keys is not None or self.group_idx is not None:
                # Trailing places, ignored by consumers of the 6-field layout.
                wire += [self.lora_name, None if extra_keys is None else
                         [None if entry is None else list(entry) for entry in extra_keys],
                         self.group_idx]
            return wire
        wire = {"type": "BlockStored", "block_hashes": list(self.block_hashes),
                "parent_block_hash": self.parent_block_hash, "token_ids": list(self.token_ids),
                "block_size": self.block_size, "lora_id": self.lora_id, "medium": self.medium,
                "lora_name": self.lora_name}
        if self.extra_keys is not None:
            wire["extra_keys"] = [None if entry is None else list(entry)
                                  for entry in self.extra_keys]
        if self.group_idx is not None:
            wire["group_idx"] = self.group_idx
        if self.cache_salt is not None:
            wire["cache_salt"] = self.cache_salt
        return wire


@dataclass(frozen=True)
class BlockRemoved:
    """Pages that left the cache (an evicted leaf).

    Attributes:
        block_hashes: The hash of each page.
        medium: Where the blocks lived, or None.
        group_idx: The KV-cache group, or None.
    """

    block_hashes: Tuple[Union[int, bytes], ...]
    medium: Optional[str] = None
    group_idx: Optional[int] = None

    def to_wire(self, encoding: str = DEFAULT_ENCODING) -> Union[dict, list]:
        """This event as msgpack-ready data (see the wire format in ``radixcache.events``).

        Args:
            encoding: ``"map"`` (vLLM's tagged maps, the default) or ``"positional"``
                (tagged arrays, for older consumers).

        Returns:
            A dict (map) or a list (positional).

        Raises:
            ValueError: an unknown ``encoding``.
        """
        if _check_encoding(encoding) == "positional":
            if self.group_idx is not None:
                return ["BlockRemoved", list(self.block_hashes), self.medium, self.group_idx]
            return ["BlockRemoved", list(self.block_hashes), self.medium]
        wire = {"type": "BlockRemoved", "block_hashes": list(self.block_hashes),
                "medium": self.medium}
        if self.group_idx is not None:
            wire["group_idx"] = self.group_idx
        return wire


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every page left the cache (``reset()``)."""

    def to_wire(self, encoding: str = DEFAULT_ENCODING) -> Union[dict, list]:
        """This event as msgpack-ready data (see the wire format in ``radixcache.events``).

        Args:
            encoding: ``"map"`` (vLLM's tagged maps, the default) or ``"positional"``
                (tagged arrays, for older consumers).

        Returns:
            A dict (map) or a list (positional).

        Raises:
            ValueError: an unknown ``encoding``.
        """
        if _check_encoding(encoding) == "positional":
            return ["AllBlocksCleared"]
        return {"type": "AllBlocksCleared"}


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


# Pickles and reprs name the public module, as they did before the package was split into
# modules: pickles stay loadable by every version, however the package is laid out.
for _cls in _EVENT_TYPES:
    _cls.__module__ = "radixcache.events"
del _cls
