"""Block index and page hashes, pure Python: the reference and the fallback of ``_blocks_c``.

Not part of the tree: the router's ``KvIndexer`` keys and tracks blocks with them, and the
fleet simulation's workers hash pages with them. ``_blocks_c`` implements exactly this
interface; the chooser ``_core`` picks between the two by the tree cores' rule
(``_core.blocks``, or ``_core.get_blocks(name)``).

Interface shared by both modules
--------------------------------
``page_hash_chain(seed, data, page_bytes) -> list[int]`` -- the chained 64-bit hashes of the
full pages of ``data`` (bytes holding int64 little-endian token ids; ``page_bytes`` a
positive multiple of 8; a trailing partial page is ignored). ``h = seed mod 2**64``; per
page, per token ``t`` (as uint64): ``h = ((h ^ t) * 0x9E3779B97F4A7C15) mod 2**64; h ^= h >>
32``; then the page's hash is ``h = fmix64(h)``
(MurmurHash3's finaliser), which also starts the next page; each is returned as a signed
int64. Not cryptographic; the same in both modules and in every process. ``TypeError`` when
``data`` is not exactly ``bytes`` or ``seed``/``page_bytes`` not exactly ``int`` (no
subclass runs code during the call), ``ValueError`` for a bad ``page_bytes``. The KV
indexer keys blocks and the fleet simulation's workers hash pages with it.

``page_hash_bytes(seed, data, page_bytes) -> bytes`` -- ``page_hash_chain``'s hashes as
native int64 bytes (8 per full page; no int objects made), with the same checks, except that
``data`` may also be a 1-D little-endian int64 numpy array (exactly ``numpy.ndarray``; its
memory is read in place; another dtype, shape or a strided array is a ``TypeError``).

``ids_le_bytes(items) -> bytes`` -- a list or tuple of exact ints (token ids) as int64
little-endian bytes, read in one pass: another item is a ``TypeError``, one beyond int64 an
``OverflowError``, each naming its position (``KvIndexer`` reads an event's token ids so).

``msgpack_ids(data) -> bytes | None`` -- ``data``, the bytes of one msgpack value, as
int64 little-endian bytes when it is exactly an array of ints that fit in int64 (any of
msgpack's int forms); None for anything else (another value, an int beyond int64, bytes
missing or left over). ``KvIndexer`` reads a payload's token ids so, undecoded.

``json_ids(data, start=0, stop=None) -> bytes | None`` -- ``data[start:stop]`` (``stop``
None: the end), the bytes of one JSON value, as int64 little-endian bytes when it is
exactly an array of token ids: integers in ``[0, 2**32)`` written in decimal without sign,
fraction, exponent or leading zero, JSON whitespace (space, tab, newline, carriage return)
allowed around the brackets, commas and ids; None for anything else (another value or
form, an id out of range, bytes left over). ``start`` and ``stop`` must be exact ints (or
``stop`` None) with ``0 <= start <= stop <= len(data)`` (TypeError, ValueError): the value
is read in place, not copied out of a larger body. The index service reads a query's token
ids so, without making an int object per id; a caller that gets None decodes the body
otherwise for its answer.

``query_answer(rows, block_size, tenant) -> bytes`` -- the index service's ``/query``
answer as JSON bytes, in one call. ``rows`` is a list of ``((instance, name, rank), (gpu,
cpu, disk))``, or ``((instance, name, rank), blocks)`` for the same figure on every tier,
one per worker found: ``instance`` exactly an int or a str (the rows of one instance make
one answer: each figure the largest of its rows', and per rank the largest device
figure), ``name`` its JSON object key (exactly ``bytes``, written as given: a JSON
string), ``rank`` an int in ``[0, 2**31)``, the figures blocks (ints in ``[0, 2**40)``),
written times ``block_size`` (an int in ``[1, 2**20]``). With ``tenant`` None it is Dynamo's
``{"scores": {name: {rank: gpu}}, "frequencies": [], "instances": {name: {"longest_matched":
disk, "gpu", "dp": {rank: gpu}, "cpu", "disk"}}}`` of the instances with ``disk`` above 0
(``scores``: those with ``gpu`` above 0, their ranks with a device hit when they have
several); with ``tenant`` bytes (its JSON string), Mooncake's ``{tenant: {name:
{"longest_matched", "GPU", "DP", "CPU", "DISK"}}}`` of every instance, ``{}`` when there is
none. Ranks ascend; instances come in the order of their first rows, and instances whose names
are equal take the first one's place with the last one's figures (a JSON object's key once).
Written compactly, as ``msgspec.json`` writes the same objects. ``TypeError`` for an argument
or row of another type, ``ValueError`` for a number out of range, each naming the row.

``BlockIndex()`` -- ``KvIndexer``'s table of held blocks, a map from a 64-bit block key (an
``int`` in int64) to the copies holding it (``copy``: an ``int`` in ``[0, 2**31 - 1)`` the
caller assigns; a copy counts once per holding, so it may hold a key more than once).
``len()`` is the number of distinct keys held, ``pairs`` the number of holdings. ``keys``
arguments are a list or tuple of ints or native int64 bytes, read whole before anything
changes. ``hold(key, copy)`` adds one holding;
``unhold(key, copy) -> bool`` removes one (False: none); ``holds(key, copy) -> bool``;
``holders(key) -> list`` (the copies, a copy once per holding, earliest first, ``[]`` when
none); ``add(copy, keys) -> int`` holds every key once more (returns ``len(keys)``);
``store(copy, keys) -> (stored, duplicates)`` holds, in order, each key ``copy`` does not
hold yet and counts the others; ``remove(copy, keys) -> (removed, unknown)`` removes one
holding per key, counting keys ``copy`` did not hold; ``clear_copy(copy) -> int`` removes
all of ``copy``'s holdings and returns how many; ``overlap(seed, data, page_bytes, owners)
-> list`` hashes the pages of ``data`` as ``page_hash_chain(seed, data, page_bytes)`` does
(same argument checks; ``data`` may also be a list of exact ints, the token ids, read in one
pass: another item is a ``TypeError``, one beyond int64 an ``OverflowError``; or a 1-D
little-endian int64 numpy array as ``page_hash_bytes`` takes it, read in place) and walks them
while held: ``owners[copy]`` is the owner a copy counts for (an int in ``[0, len(owners))``, or -1:
not counted; copies past the end are not counted); an owner holds a page when one of its copies
does. It returns ``[(owner,
depth)]``, the leading pages each owner holding the first page holds, and stops at the
first page that no owner still in the run holds (the compiled module hashes pages in batches of
up to 16 before it probes them, to fetch their table slots meanwhile; nothing past the stop
counts). Errors:
``TypeError`` for a key, copy or keys of another type (``bool`` included), ``OverflowError``
for a key outside int64, ``ValueError`` for a copy or owner out of range or bytes not a
multiple of 8, each leaving the index unchanged. It pickles and copies (its holdings, in
native byte order; a compiled one loads where ``_blocks_c`` is built). No Python code runs
while the compiled one is written; it frees a table slot with its last holding and shrinks as
keys leave (16 bytes a slot, kept between a quarter and three quarters full: as keys arrive,
a key costs 21 to 32 bytes of table at any size).

``KeyMap()`` -- a map from publisher hashes (an ``int``, or ``bytes``) to block keys (ints in
int64), ``KvIndexer``'s per-copy map of the hashes a worker publishes. A hash is kept as
``hash64(value)``: 64 bits, never 0 (an int by its value mod 2**64, bytes by their content;
two hashes are told apart by those 64 bits), so an entry costs the same whatever the
publisher sends (16 bytes in the compiled one, at most 80% full). ``get(h, default=None)``,
``pop(h, default=None)``, ``put(h, key)``, ``h in m``, ``len(m)``, ``values()`` (the keys, a
key once per hash), ``clear()``; ``isdisjoint(hashes) -> bool`` (no hash of ``hashes`` is
held and none is there twice); ``update(hashes, keys)`` maps ``hashes[i]`` to ``keys[i]``
(``keys`` as ``BlockIndex`` takes them); ``add_new(hashes, keys) -> bool`` does so only
when ``isdisjoint(hashes)`` (True), else changes nothing (False), with ``update``'s checks.
A hash of another type is a ``TypeError`` (an
object with ``__index__`` counts as the int it gives). It pickles and copies.

``read_wire(data) -> WireBatch | None`` -- ``KvIndexer``'s one-call ingest of a wire payload
(``data``: exactly ``bytes``, else a ``TypeError``), first half: the batch read whole and
checked, into a ``WireBatch`` of its own (it never looks at ``data`` again), or None for a
payload it does not read, which the caller reads otherwise (``decode_batch``). It reads
``[ts, [events...]]`` or ``[ts, [events...], data_parallel_rank]`` (``ts`` an int or a
float, the rank nil or an int) whose events are all tagged maps or all tagged arrays, the
layouts and fields of "Wire format" in ``radixcache.events``, with: block hashes and a
parent that are ints (any msgpack int) or bin; token ids, ``block_size`` and ``group_idx``
ints in int64; ``medium`` nil or an ASCII str of at most 64 bytes; ``lora_id``,
``lora_name`` and ``cache_salt`` nil; ``extra_keys`` nil or an array of nils; every
str ASCII; no field twice; fields no event has (a map's other keys, an array's places past
the known ones) skipped, any value but an ext, nested at most 8 deep; and one copy for all its
stores and removals (the same ``medium``, nil being ``"GPU"``, and the same ``group_idx``).
Every payload it reads is one ``decode_batch`` reads, event for event; both modules read
exactly the same payloads. ``len(batch)`` is its events; ``batch.medium`` the ``medium`` of
its stores and removals (``"GPU"`` for nil; None when it has none), ``batch.group`` their
``group_idx``. It neither pickles nor copies.

``apply_wire(index, batch, start, keymap, copy, direct, block_size, seed, alone, ns) ->
tuple`` -- the second half: ``batch``'s events from position ``start`` applied in order to one
copy's holdings, as ``KvIndexer`` applies them to a copy whose hashes are in ``keymap`` (a
``KeyMap``) and ``direct`` holdings in ``index`` under their own keys, copy id ``copy``, until
an event it leaves to the caller. A ``BlockStored`` of another ``block_size`` is counted and
skipped, one whose token ids do not fill its blocks is malformed; its parent is looked up in
``keymap``, else among the copy's own-key holdings (an int parent or hash names the key equal
to it modulo 2**64, as ``KeyMap`` takes ints); a root block's chain starts from ``seed``
(``page_hash_chain``); a parent it does not find is counted unknown when ``alone`` (no other
copy of the worker in the same group may hold it), else left to the caller. Blocks published
under their own keys (every hash an int equal to its key modulo 2**64) are held like
``BlockIndex.store``; others like ``KeyMap.add_new`` then ``BlockIndex.add`` when all are new,
else one at a time (a hash held for the same key is a duplicate, for another key it is moved).
A ``BlockRemoved`` takes the holding each hash names. It leaves to the caller: an
``AllBlocksCleared``, an event with ``extra_keys`` and a parent when ``ns`` (the caller keeps
namespaces), a store that would hold blocks both under their own keys and in ``keymap``, and
everything when the copy holds both ways already. Returns ``(next, stored, duplicates,
removed, unknown_removals, unknown_parent, wrong_block_size, malformed, direct)``: the
position of the first event not applied (``len(batch)`` when all were), the counts, and the
copy's own-key holdings after. No Python code runs while it applies (its arguments are checked
first: ``TypeError`` for another type, ``ValueError`` for ``start``, ``copy``, ``direct`` or
``block_size`` out of range, each changing nothing).

``recv_stream(handle, limit, expected) -> tuple | None`` -- an event subscriber's stream
read without waiting, in one call: the messages that have arrived on the ZeroMQ socket whose
libzmq address is ``handle`` (pyzmq's ``Socket.underlying``; the caller keeps it open and
owns it for the call), each ``[topic, seq, payload]`` (``seq``: 8 bytes, a big-endian signed
int). It reads while each is the batch expected next (``expected``, then one more each), up
to ``limit`` of them, and stops after the first that is not. Returns ``(payloads, malformed,
last, error)``: the payloads of the batches ``expected``, ``expected + 1``, ... in order;
how many messages it read and skipped for their shape (not three frames, a ``seq`` frame not 8
bytes long, a negative ``seq``); ``(seq, payload)`` of the message that stopped it, or None;
and libzmq's errno of a failed read (0 when it stopped because nothing more had arrived; a
message is never read in part). ``handle``, ``limit`` and ``expected`` are exactly ints
(``TypeError``) with ``handle`` in (0, 2**64), ``limit >= 1`` and ``expected`` in [0, 2**63)
(``ValueError``), checked before anything is read. The compiled module reads through libzmq's
own calls, bound to the library that made the socket, and answers None where they cannot be
bound; this one reads through pyzmq (a socket ``shadow`` of ``handle``).
"""

from __future__ import annotations

import operator
import re
import sys
from array import array
from typing import Any

import numpy as np

from ._validate import INT64_MAX, INT64_MIN, wrap_int64

__all__ = ["BlockIndex", "KeyMap", "WireBatch", "apply_wire", "hash64", "ids_le_bytes",
           "json_ids", "msgpack_ids", "page_hash_bytes", "page_hash_chain", "query_answer",
           "read_wire", "recv_stream"]


# -- page hash chain (see the module docstring) ---------------------------------------------
_MASK64 = (1 << 64) - 1
_CHAIN_MUL = 0x9E3779B97F4A7C15
_FMIX_1 = 0xFF51AFD7ED558CCD
_FMIX_2 = 0xC4CEB9FE1A85EC53


def _check_chain_args(seed: Any, data: Any, page_bytes: Any) -> None:
    if type(data) is not bytes:
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    for name, value in (("seed", seed), ("page_bytes", page_bytes)):
        if type(value) is not int:  # exactly int: a subclass could change // or &
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if page_bytes <= 0 or page_bytes % 8:
        raise ValueError(f"page_bytes must be a positive multiple of 8, got {page_bytes}")


def page_hash_chain(seed: int, data: bytes, page_bytes: int) -> list:
    """The chained 64-bit hashes of the full pages of ``data``; see the module docstring."""
    _check_chain_args(seed, data, page_bytes)
    mask, mul, f1, f2 = _MASK64, _CHAIN_MUL, _FMIX_1, _FMIX_2
    tokens = np.frombuffer(data, dtype="<u8", count=len(data) // 8).tolist()
    per_page = page_bytes // 8
    h = seed & mask
    out = []
    for start in range(0, len(tokens) - per_page + 1, per_page):
        for t in tokens[start:start + per_page]:
            h = ((h ^ t) * mul) & mask
            h ^= h >> 32
        h ^= h >> 33
        h = (h * f1) & mask
        h ^= h >> 33
        h = (h * f2) & mask
        h ^= h >> 33
        out.append(h - (1 << 64) if h >> 63 else h)
    return out


# -- block index (see the module docstring) -------------------------------------------------
def _index_copy(copy: Any) -> int:
    if type(copy) is not int:
        raise TypeError(f"copy must be an int, got {type(copy).__name__}")
    if not 0 <= copy < 0x7FFFFFFF:
        raise ValueError(f"copy must be in [0, 2**31 - 1), got {copy}")
    return copy


def _index_key(key: Any) -> int:
    if type(key) is not int:
        raise TypeError(f"key must be an int, got {type(key).__name__}")
    if not INT64_MIN <= key <= INT64_MAX:
        raise OverflowError(f"key {key} does not fit in int64")
    return key


def _index_keys(keys: Any) -> list:
    """``keys`` as a new list of int64 ints: a list or tuple of ints, or bytes."""
    if type(keys) is bytes:
        if len(keys) % 8:
            raise ValueError(f"keys as bytes must hold int64 values (a multiple of 8 bytes), "
                             f"got {len(keys)} bytes")
        return np.frombuffer(keys, dtype=np.int64).tolist()
    if type(keys) is not list and type(keys) is not tuple:
        raise TypeError(f"keys must be a list or tuple of ints, or bytes, got "
                        f"{type(keys).__name__}")
    out = list(keys)
    for i, item in enumerate(out):
        if type(item) is not int:
            raise TypeError(f"keys must be ints, got {type(item).__name__} at position {i}")
        if not INT64_MIN <= item <= INT64_MAX:
            raise OverflowError(f"key {item} at position {i} does not fit in int64")
    return out


class BlockIndex:
    """Held blocks: 64-bit block key -> the copies (ints) holding it; see the module docstring."""

    __slots__ = ("_holders", "_pairs")

    def __init__(self) -> None:
        # key -> the holding copy (an int), or a list of them (a copy once per holding)
        self._holders: dict = {}
        self._pairs = 0

    def __reduce__(self) -> Any:
        keys, copies = [], []
        for key, current in self._holders.items():
            for copy in current if type(current) is list else (current,):
                keys.append(key)
                copies.append(copy)
        return (_block_index_from, (np.array(keys, dtype=np.int64).tobytes(),
                                    np.array(copies, dtype=np.int32).tobytes()))

    def __len__(self) -> int:
        return len(self._holders)

    @property
    def pairs(self) -> int:
        """Holdings: (key, copy) pairs, a copy counted once per holding."""
        return self._pairs

    def _hold(self, key: int, copy: int) -> None:
        holders = self._holders
        current = holders.get(key)
        if current is None:
            holders[key] = copy
        elif type(current) is list:
            current.append(copy)
        else:
            holders[key] = [current, copy]
        self._pairs += 1

    def _drop(self, key: int, copy: int) -> bool:
        holders = self._holders
        current = holders.get(key)
        if current is None:
            return False
        if type(current) is list:
            try:
                current.remove(copy)
            except ValueError:
                return False
            if len(current) == 1:
                holders[key] = current[0]
        elif current == copy:
            del holders[key]
        else:
            return False
        self._pairs -= 1
        return True

    def _has(self, key: int, copy: int) -> bool:
        current = self._holders.get(key)
        return current == copy if type(current) is int else (
            current is not None and copy in current)

    def hold(self, key: int, copy: int) -> None:
        key, copy = _index_key(key), _index_copy(copy)
        self._hold(key, copy)

    def unhold(self, key: int, copy: int) -> bool:
        key, copy = _index_key(key), _index_copy(copy)
        return self._drop(key, copy)

    def holds(self, key: int, copy: int) -> bool:
        key, copy = _index_key(key), _index_copy(copy)
        return self._has(key, copy)

    def holders(self, key: int) -> list:
        current = self._holders.get(_index_key(key))
        if current is None:
            return []
        return list(current) if type(current) is list else [current]

    def add(self, copy: int, keys: Any) -> int:
        copy = _index_copy(copy)
        keys = _index_keys(keys)
        for key in keys:
            self._hold(key, copy)
        return len(keys)

    def store(self, copy: int, keys: Any) -> tuple:
        copy = _index_copy(copy)
        stored = duplicates = 0
        for key in _index_keys(keys):
            if self._has(key, copy):
                duplicates += 1
            else:
                self._hold(key, copy)
                stored += 1
        return stored, duplicates

    def remove(self, copy: int, keys: Any) -> tuple:
        copy = _index_copy(copy)
        keys = _index_keys(keys)
        removed = sum(1 for key in keys if self._drop(key, copy))
        return removed, len(keys) - removed

    def clear_copy(self, copy: int) -> int:
        copy = _index_copy(copy)
        holders = self._holders
        dropped = 0
        for key in list(holders):
            current = holders[key]
            if type(current) is list:
                kept = [c for c in current if c != copy]
                dropped += len(current) - len(kept)
                if not kept:
                    del holders[key]
                elif len(kept) == 1:
                    holders[key] = kept[0]
                else:
                    holders[key] = kept
            elif current == copy:
                del holders[key]
                dropped += 1
        self._pairs -= dropped
        return dropped

    def overlap(self, seed: int, data: Any, page_bytes: int, owners: Any) -> list:
        if type(data) is np.ndarray:
            if data.dtype.str != "<i8" or data.ndim != 1 or not data.flags.c_contiguous:
                raise TypeError(f"data as an array must be 1-D contiguous little-endian int64, "
                                f"got {data.ndim}-D {data.dtype}")
            data = data.tobytes()
        elif type(data) is list:
            data = _list_le_bytes(data)
        elif type(data) is not bytes:
            raise TypeError(f"data must be bytes, a list of ints or an int64 numpy array, got "
                            f"{type(data).__name__}")
        _check_chain_args(seed, data, page_bytes)
        owners = _index_keys(owners)
        n_owners = len(owners)
        for i, owner in enumerate(owners):
            if not -1 <= owner < n_owners:
                raise ValueError(f"owners must be -1 or in [0, {n_owners}), got {owner} at "
                                 f"position {i}")
        out = []
        active = None  # owners holding every block so far, in first-seen order
        depth = 0
        holders = self._holders
        for key in page_hash_chain(seed, data, page_bytes):
            current = holders.get(key)
            if current is None:
                break
            copies = current if type(current) is list else (current,)
            held = [owners[c] for c in copies if c < n_owners and owners[c] >= 0]
            if active is None:
                active = list(dict.fromkeys(held))
            else:
                held = set(held)
                out.extend((owner, depth) for owner in active if owner not in held)
                active = [owner for owner in active if owner in held]
            if not active:
                break
            depth += 1
        out.extend((owner, depth) for owner in active or ())
        return out


def _list_le_bytes(items: Any) -> bytes:
    """A list (or tuple) of exact ints as int64 little-endian bytes (``overlap``'s ``data``)."""
    for i, item in enumerate(items):
        if type(item) is not int:
            raise TypeError(f"token ids must be ints, got {type(item).__name__} at position {i}")
        if not INT64_MIN <= item <= INT64_MAX:
            raise OverflowError(f"token id {item} at position {i} does not fit in int64")
    return np.array(items, dtype="<i8").tobytes()


def ids_le_bytes(items: Any) -> bytes:
    """A list or tuple of exact ints as int64 little-endian bytes; see the module docstring."""
    if type(items) is not list and type(items) is not tuple:
        raise TypeError(f"token ids must be a list or tuple, got {type(items).__name__}")
    if set(map(type, items)) <= _INT_ONLY:  # the types in one pass, then the values
        try:
            out = array("q", items)
        except OverflowError:
            pass  # named below
        else:
            if sys.byteorder != "little":
                out.byteswap()
            return out.tobytes()
    return _list_le_bytes(items)


_INT_ONLY = frozenset((int,))

try:  # the wire's optional decoder: an array of ints read without a Python loop
    import msgspec
    _IDS_DECODER: Any = msgspec.msgpack.Decoder(list[int])
    _IDS_DECODER_ERROR: Any = msgspec.DecodeError
except ImportError:  # then the loop in msgpack_ids
    _IDS_DECODER = None

# msgpack's int forms past the fixints: first byte -> (width, signed)
_MSGPACK_INTS = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
                 0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}


#: ``json_ids``'s grammar: an array of unsigned decimal integers, JSON whitespace around.
_JSON_IDS = re.compile(rb"[ \t\n\r]*\[[ \t\n\r]*(?:(?:0|[1-9][0-9]*)[ \t\n\r]*"
                       rb"(?:,[ \t\n\r]*(?:0|[1-9][0-9]*)[ \t\n\r]*)*)?\][ \t\n\r]*")
_JSON_ID = re.compile(rb"[0-9]+")


def json_ids(data: Any, start: Any = 0, stop: Any = None) -> Any:
    """A JSON array of token ids (``data[start:stop]``) as int64 little-endian bytes, or
    None; see the module docstring."""
    if type(data) is not bytes:
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    if type(start) is not int:
        raise TypeError(f"start must be an int, got {type(start).__name__}")
    if stop is not None and type(stop) is not int:
        raise TypeError(f"stop must be an int or None, got {type(stop).__name__}")
    size = len(data)
    if not 0 <= start <= (size if stop is None else stop) <= size:
        raise ValueError(f"start and stop must be within the data (0 <= start <= stop <= "
                         f"{size}), got {start} and {stop}")
    data = data[start:stop]
    if _JSON_IDS.fullmatch(data) is None:
        return None
    found = _JSON_ID.findall(data)
    # More than 10 digits is 2**32 or beyond (and int() refuses 4,300 digits and more).
    if any(len(digits) > 10 for digits in found):
        return None
    ids = [int(digits) for digits in found]
    if any(i >= 1 << 32 for i in ids):
        return None
    out = array("q", ids)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


#: ``query_answer``'s keys of an instance's figures, per dialect.
_DYNAMO_KEYS = (b'"longest_matched":', b',"gpu":', b',"dp":{', b'},"cpu":', b',"disk":')
_MOONCAKE_KEYS = (b'"longest_matched":', b',"GPU":', b',"DP":{', b'},"CPU":', b',"DISK":')


def _answer_int(value: Any, what: str, top: int) -> int:
    if type(value) is not int:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if not 0 <= value < top:
        raise ValueError(f"{what} must be in [0, {top}), got {value}")
    return value


def query_answer(rows: Any, block_size: Any, tenant: Any) -> bytes:
    """The index service's ``/query`` answer as JSON bytes; see the module docstring."""
    if type(rows) is not list:
        raise TypeError(f"rows must be a list, got {type(rows).__name__}")
    if type(block_size) is not int:
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if not 1 <= block_size <= 1 << 20:
        raise ValueError(f"block_size must be in [1, 2**20], got {block_size}")
    if tenant is not None and type(tenant) is not bytes:
        raise TypeError(f"tenant must be bytes or None, got {type(tenant).__name__}")
    merged: dict = {}  # instance -> [name, gpu, cpu, disk, {rank: gpu}]
    for i, row in enumerate(list(rows)):
        if type(row) is not tuple or len(row) != 2 or type(row[0]) is not tuple \
                or len(row[0]) != 3 or not (type(row[1]) is int or (
                    type(row[1]) is tuple and len(row[1]) == 3)):
            raise TypeError(f"rows[{i}] must be ((instance, name, rank), (gpu, cpu, disk)) "
                            "or ((instance, name, rank), blocks)")
        (instance, name, rank), figures = row
        if type(figures) is int:
            figures = (figures, figures, figures)
        if type(instance) is not int and type(instance) is not str:
            raise TypeError(f"rows[{i}]: instance must be an int or a str, got "
                            f"{type(instance).__name__}")
        if type(name) is not bytes:
            raise TypeError(f"rows[{i}]: name must be bytes, got {type(name).__name__}")
        rank = _answer_int(rank, f"rows[{i}]: rank", 1 << 31)
        gpu, cpu, disk = (_answer_int(v, f"rows[{i}]: blocks", 1 << 40) * block_size
                          for v in figures)
        entry = merged.get(instance)
        if entry is None:
            merged[instance] = [name, gpu, cpu, disk, {rank: gpu}]
            continue
        entry[1], entry[2], entry[3] = max(entry[1], gpu), max(entry[2], cpu), max(entry[3], disk)
        entry[4][rank] = max(entry[4].get(rank, gpu), gpu)
    keys = _DYNAMO_KEYS if tenant is None else _MOONCAKE_KEYS
    scores: dict = {}
    instances: dict = {}
    for name, gpu, cpu, disk, dp in merged.values():
        if tenant is None and not disk:
            continue
        ranks = sorted(dp.items())
        dp_text = b",".join(b'"%d":%d' % r for r in ranks)
        instances[name] = b"".join((name, b":{", keys[0], b"%d" % disk, keys[1], b"%d" % gpu,
                                    keys[2], dp_text, keys[3], b"%d" % cpu, keys[4],
                                    b"%d}" % disk))
        if tenant is None and gpu:
            if len(ranks) > 1:
                dp_text = b",".join(b'"%d":%d' % r for r in ranks if r[1])
            scores[name] = b"".join((name, b":{", dp_text, b"}"))
    body = b",".join(instances.values())
    if tenant is None:
        return b"".join((b'{"scores":{', b",".join(scores.values()),
                         b'},"frequencies":[],"instances":{', body, b"}}"))
    return b"".join((b"{", tenant, b":{", body, b"}}")) if merged else b"{}"


def msgpack_ids(data: Any) -> Any:
    """A msgpack array of ints as int64 little-endian bytes, or None; see the module
    docstring."""
    if type(data) is not bytes:
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    if _IDS_DECODER is not None:  # msgspec checks the array and its items in C
        try:
            return ids_le_bytes(_IDS_DECODER.decode(data))
        except (_IDS_DECODER_ERROR, OverflowError):
            return None
    if not data:
        return None
    head = data[0]
    if 0x90 <= head <= 0x9F:
        n, pos = head & 0x0F, 1
    elif head == 0xDC and len(data) >= 3:
        n, pos = int.from_bytes(data[1:3], "big"), 3
    elif head == 0xDD and len(data) >= 5:
        n, pos = int.from_bytes(data[1:5], "big"), 5
    else:
        return None
    if n > len(data) - pos:
        return None
    ids = []
    for _ in range(n):
        if pos >= len(data):
            return None
        b = data[pos]
        if b <= 0x7F:
            ids.append(b)
            pos += 1
        elif b >= 0xE0:
            ids.append(b - 256)
            pos += 1
        elif b in _MSGPACK_INTS:
            width, signed = _MSGPACK_INTS[b]
            if width > len(data) - pos - 1:
                return None
            value = int.from_bytes(data[pos + 1:pos + 1 + width], "big", signed=signed)
            if value > INT64_MAX:
                return None
            ids.append(value)
            pos += 1 + width
        else:
            return None
    if pos != len(data):
        return None
    return np.array(ids, dtype="<i8").tobytes()


def page_hash_bytes(seed: int, data: Any, page_bytes: int) -> bytes:
    """``page_hash_chain`` as native int64 bytes; see the module docstring."""
    if type(data) is np.ndarray:
        if data.dtype.str != "<i8" or data.ndim != 1 or not data.flags.c_contiguous:
            raise TypeError(f"data as an array must be 1-D contiguous little-endian int64, got "
                            f"{data.ndim}-D {data.dtype}")
        data = data.tobytes()
    elif type(data) is not bytes:
        raise TypeError(f"data must be bytes or an int64 numpy array, got {type(data).__name__}")
    return np.array(page_hash_chain(seed, data, page_bytes), dtype=np.int64).tobytes()


def _block_index_from(keys: Any, copies: Any) -> BlockIndex:
    """A ``BlockIndex`` holding ``keys[i]`` for ``copies[i]`` (int64 and int32 bytes), in order."""
    if (type(keys) is not bytes or type(copies) is not bytes or len(keys) % 8
            or len(copies) % 4 or len(keys) // 8 != len(copies) // 4):
        raise ValueError("malformed BlockIndex state")
    copy_list = np.frombuffer(copies, dtype=np.int32).tolist()
    if any(not 0 <= c < 0x7FFFFFFF for c in copy_list):
        raise ValueError("malformed BlockIndex state")
    index = BlockIndex()
    for key, copy in zip(np.frombuffer(keys, dtype=np.int64).tolist(), copy_list):
        index._hold(key, copy)
    return index


# -- publisher hash map (see the module docstring) ------------------------------------------
_KM_INT_SALT = 0x6A09E667F3BCC909
_KM_BYTES_SALT = 0xBB67AE8584CAA73B


def _fmix64(h: int) -> int:
    h ^= h >> 33
    h = (h * _FMIX_1) & _MASK64
    h ^= h >> 33
    h = (h * _FMIX_2) & _MASK64
    h ^= h >> 33
    return h


def hash64(value: Any) -> int:
    """``value`` (an int, or bytes) as the nonzero 64-bit hash a ``KeyMap`` keeps."""
    if type(value) is bytes:
        n = len(value)
        h = n ^ _KM_BYTES_SALT
        for i in range(0, n, 8):
            w = int.from_bytes(value[i:i + 8], "little")
            h = (_fmix64(h ^ w) + _CHAIN_MUL) & _MASK64
        h = _fmix64(h)
    elif type(value) is int:
        h = _fmix64((value & _MASK64) ^ _KM_INT_SALT)
    elif isinstance(value, bytes):
        return hash64(bytes(value))
    else:
        return hash64(int(operator.index(value)))
    return h or 1


class KeyMap:
    """Publisher hash (an int, or bytes) -> block key (an int64); see the module docstring."""

    __slots__ = ("_map",)

    def __init__(self) -> None:
        self._map: dict = {}

    def __reduce__(self) -> Any:
        items = np.empty((len(self._map), 2), dtype=np.uint64)
        items[:, 0] = np.array(list(self._map), dtype=np.uint64)
        items[:, 1] = np.array(list(self._map.values()), dtype=np.int64).view(np.uint64)
        return (_key_map_from, (items.tobytes(),))

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, block_hash: Any) -> bool:
        return hash64(block_hash) in self._map

    def get(self, block_hash: Any, default: Any = None) -> Any:
        return self._map.get(hash64(block_hash), default)

    def pop(self, block_hash: Any, default: Any = None) -> Any:
        return self._map.pop(hash64(block_hash), default)

    def put(self, block_hash: Any, key: int) -> None:
        h = hash64(block_hash)
        self._map[h] = _index_key(key)

    def isdisjoint(self, hashes: Any) -> bool:
        hs = [hash64(value) for value in hashes]
        return len(set(hs)) == len(hs) and self._map.keys().isdisjoint(hs)

    def update(self, hashes: Any, keys: Any) -> None:
        hs = [hash64(value) for value in hashes]
        keys = _index_keys(keys)
        if len(hs) != len(keys):
            raise ValueError(f"{len(hs)} hashes for {len(keys)} keys")
        self._map.update(zip(hs, keys))

    def add_new(self, hashes: Any, keys: Any) -> bool:
        hs = [hash64(value) for value in hashes]
        keys = _index_keys(keys)
        if len(hs) != len(keys):
            raise ValueError(f"{len(hs)} hashes for {len(keys)} keys")
        if len(set(hs)) != len(hs) or not self._map.keys().isdisjoint(hs):
            return False
        self._map.update(zip(hs, keys))
        return True

    def values(self) -> list:
        return list(self._map.values())

    def clear(self) -> None:
        self._map = {}


def _key_map_from(state: Any) -> KeyMap:
    """A ``KeyMap`` holding the (hash, key) pairs of ``state`` (uint64, int64 pairs)."""
    if type(state) is not bytes or len(state) % 16:
        raise ValueError("malformed KeyMap state")
    pairs = np.frombuffer(state, dtype=np.uint64).reshape(-1, 2)
    if (pairs[:, 0] == 0).any():
        raise ValueError("malformed KeyMap state")
    out = KeyMap()
    out._map = dict(zip(pairs[:, 0].tolist(), pairs[:, 1].view(np.int64).tolist()))
    return out


# -- wire batches (see the module docstring) ------------------------------------------------
_MP_DEPTH = 8  # how deeply a value of a field not read may nest
_STORED, _REMOVED, _CLEARED = 1, 2, 3
_EVENT_TAGS = {"BlockStored": _STORED, "BlockRemoved": _REMOVED, "AllBlocksCleared": _CLEARED}
_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
           "lora_name", "extra_keys", "group_idx", "cache_salt", "type")
_F_HASHES, _F_PARENT, _F_TOKENS, _F_BLOCK_SIZE, _F_MEDIUM, _F_GROUP, _F_TYPE = 0, 1, 2, 3, 5, 8, 10


class _Decline(Exception):
    """Not a batch ``read_wire`` reads."""


class _Reader:
    """msgpack values as ``read_wire`` reads them, from ``pos`` (see the module docstring)."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise _Decline
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def next(self) -> tuple:
        """``(kind, value)``: ("int", int), ("nil"|"bool"|"float", None), ("str", str),
        ("bin", bytes), ("array"|"map", count)."""
        b = self._take(1)[0]
        if b <= 0x7F:
            return "int", b
        if b >= 0xE0:
            return "int", b - 256
        if 0xCC <= b <= 0xD3:
            width = 1 << ((b - 0xCC) & 3)
            return "int", int.from_bytes(self._take(width), "big", signed=b >= 0xD0)
        if b == 0xC0:
            return "nil", None
        if b in (0xC2, 0xC3):
            return "bool", None
        if b in (0xCA, 0xCB):
            self._take(4 if b == 0xCA else 8)
            return "float", None
        if 0x80 <= b <= 0x8F:
            kind, n = "map", b & 0x0F
        elif 0x90 <= b <= 0x9F:
            kind, n = "array", b & 0x0F
        elif 0xA0 <= b <= 0xBF:
            kind, n = "str", b & 0x1F
        else:
            forms = {0xD9: ("str", 1), 0xDA: ("str", 2), 0xDB: ("str", 4), 0xC4: ("bin", 1),
                     0xC5: ("bin", 2), 0xC6: ("bin", 4), 0xDC: ("array", 2),
                     0xDD: ("array", 4), 0xDE: ("map", 2), 0xDF: ("map", 4)}
            if b not in forms:
                raise _Decline  # 0xC1 (never used), ext
            kind, width = forms[b]
            n = int.from_bytes(self._take(width), "big")
        left = len(self.data) - self.pos
        if n > (left // 2 if kind == "map" else left):
            raise _Decline
        if kind == "str":
            raw = self._take(n)
            if not raw.isascii():
                raise _Decline
            return kind, raw.decode("ascii")
        if kind == "bin":
            return kind, self._take(n)
        return kind, n

    def ids(self, count: int) -> bytes:
        """The ``count`` ints (token ids) that follow, as int64 little-endian bytes: ints
        in int64 only."""
        data, pos = self.data, self.pos
        start = pos
        for _ in range(count):
            b = data[pos] if pos < len(data) else 0xC1
            if b <= 0x7F or b >= 0xE0:
                pos += 1
            elif 0xCC <= b <= 0xD3:
                pos += 1 + (1 << ((b - 0xCC) & 3))
            else:
                raise _Decline
        if pos > len(data):
            raise _Decline
        self.pos = pos
        out = msgpack_ids(b"\xdd" + count.to_bytes(4, "big") + data[start:pos])
        if out is None:  # an int beyond int64
            raise _Decline
        return out

    def skip(self, depth: int) -> None:
        kind, value = self.next()
        if kind in ("array", "map"):
            if depth >= _MP_DEPTH:
                raise _Decline
            for _ in range(value * 2 if kind == "map" else value):
                self.skip(depth + 1)


class _WireEvent:
    __slots__ = ("kind", "hashes", "parent", "tokens", "block_size", "medium", "group",
                 "extra")

    def __init__(self) -> None:
        self.kind = 0
        self.hashes: list = []
        self.parent: Any = None
        self.tokens = b""  # int64 little-endian
        self.block_size = 0
        self.medium = "GPU"
        self.group: Any = None
        self.extra = False


def _read_field(r: _Reader, field: int, e: _WireEvent) -> None:
    if field in (_F_HASHES, _F_TOKENS):
        kind, count = r.next()
        if kind != "array":
            raise _Decline
        if field == _F_TOKENS:
            e.tokens = r.ids(count)
            return
        items = []
        for _ in range(count):
            kind, value = r.next()
            if kind not in ("int", "bin"):
                raise _Decline
            items.append(value)
        e.hashes = items
        return
    kind, value = r.next()
    name = _FIELDS[field]
    if name == "parent_block_hash":
        if kind not in ("nil", "int", "bin"):
            raise _Decline
        e.parent = value
    elif name in ("block_size", "group_idx"):
        if kind == "int" and INT64_MIN <= value <= INT64_MAX:
            if name == "block_size":
                e.block_size = value
            else:
                e.group = value
        elif kind != "nil" or name == "block_size":
            raise _Decline
    elif name == "medium":
        if kind == "str" and len(value) <= 64:
            e.medium = value
        elif kind != "nil":
            raise _Decline
    elif name in ("lora_id", "lora_name", "cache_salt"):
        if kind != "nil":
            raise _Decline  # a namespace: read by KvIndexer itself
    elif name == "extra_keys":
        if kind == "array":
            e.extra = True
            for _ in range(value):
                if r.next()[0] != "nil":
                    raise _Decline
        elif kind != "nil":
            raise _Decline
    else:  # type
        if kind != "str" or value not in _EVENT_TAGS:
            raise _Decline
        e.kind = _EVENT_TAGS[value]


def _read_map_event(r: _Reader, pairs: int, e: _WireEvent) -> None:
    seen = set()
    for _ in range(pairs):
        kind, key = r.next()
        if kind != "str":
            raise _Decline
        if key not in _FIELDS:
            r.skip(1)
            continue
        field = _FIELDS.index(key)
        if field in seen:
            raise _Decline  # a field twice
        seen.add(field)
        _read_field(r, field, e)
    need = {_STORED: {_F_HASHES, _F_PARENT, _F_TOKENS, _F_BLOCK_SIZE},
            _REMOVED: {_F_HASHES}, _CLEARED: set()}.get(e.kind)
    if need is None or not need <= seen:
        raise _Decline


def _read_array_event(r: _Reader, items: int, e: _WireEvent) -> None:
    if items < 1:
        raise _Decline
    _read_field(r, _F_TYPE, e)
    if e.kind == _STORED:
        if items < 7:
            raise _Decline
        places = list(range(min(items - 1, _F_GROUP + 1)))
    elif e.kind == _REMOVED:
        if items < 3:
            raise _Decline
        places = [_F_HASHES, _F_MEDIUM, _F_GROUP][:items - 1]
    else:
        places = []
    for field in places:
        _read_field(r, field, e)
    for _ in range(items - 1 - len(places)):
        r.skip(1)


class WireBatch:
    """A batch ``read_wire`` read: its events (see the module docstring)."""

    __slots__ = ("_events", "_medium", "_group")

    def __init__(self) -> None:
        self._events: list = []
        self._medium: Any = None
        self._group: Any = None

    def __len__(self) -> int:
        return len(self._events)

    @property
    def medium(self) -> Any:
        return self._medium

    @property
    def group(self) -> Any:
        return self._group

    def __reduce__(self) -> Any:
        raise TypeError("a WireBatch is not pickled: read the payload again")


def read_wire(data: Any) -> Any:
    """A wire batch read into a ``WireBatch``, or None; see the module docstring."""
    if type(data) is not bytes:
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    r = _Reader(data)
    batch = WireBatch()
    try:
        kind, n_batch = r.next()
        if kind != "array" or not 2 <= n_batch <= 3:
            raise _Decline
        if r.next()[0] not in ("int", "float"):
            raise _Decline  # ts
        kind, n_events = r.next()
        if kind != "array":
            raise _Decline
        layout = None
        first = None
        for _ in range(n_events):
            kind, count = r.next()
            if kind not in ("map", "array") or layout not in (None, kind):
                raise _Decline  # one layout a batch
            layout = kind
            e = _WireEvent()
            if kind == "map":
                _read_map_event(r, count, e)
            else:
                _read_array_event(r, count, e)
            batch._events.append(e)
            if e.kind == _CLEARED:
                continue
            if first is None:
                first = e
            elif (first.medium, first.group) != (e.medium, e.group):
                raise _Decline  # one copy a batch
        if n_batch == 3 and r.next()[0] not in ("nil", "int"):
            raise _Decline  # data_parallel_rank
        if r.pos != len(data):
            raise _Decline
    except _Decline:
        return None
    if first is not None:
        batch._medium, batch._group = first.medium, first.group
    return batch


def apply_wire(index: BlockIndex, batch: WireBatch, start: int, keymap: KeyMap, copy: int,
               direct: int, block_size: int, seed: int, alone: bool, ns: bool) -> tuple:
    """Apply ``batch``'s events from ``start`` to one copy's holdings; see the module
    docstring."""
    if type(index) is not BlockIndex or type(batch) is not WireBatch or type(
            keymap) is not KeyMap:
        raise TypeError("apply_wire takes a BlockIndex, a WireBatch and a KeyMap")
    if type(start) is not int or type(direct) is not int or type(block_size) is not int:
        raise TypeError("start, direct and block_size must be ints")
    if type(seed) is not int:
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if type(alone) is not bool or type(ns) is not bool:
        raise TypeError("alone and ns must be bools")
    c = _index_copy(copy)
    n = len(batch._events)
    if not 0 <= start <= n:
        raise ValueError(f"start must be in [0, {n}], got {start}")
    if not 0 <= direct < 2 ** 62:
        raise ValueError(f"direct must be in [0, 2**62), got {direct}")
    if not 1 <= block_size < 2 ** 62:
        raise ValueError(f"block_size must be in [1, 2**62), got {block_size}")
    seed &= _MASK64
    d = direct
    stored = duplicates = removed = unknown_removals = unknown_parent = 0
    wrong_block_size = malformed = 0
    km = keymap._map
    if d > 0 and km:
        return (start, 0, 0, 0, 0, 0, 0, 0, d)  # held both ways: KvIndexer's own path
    ev = start
    while ev < n:
        e = batch._events[ev]
        if e.kind == _CLEARED:
            break
        hs = [hash64(h) for h in e.hashes]
        # each hash as a block's own key: an int taken modulo 2**64, as hash64 takes it
        own = [wrap_int64(h) if type(h) is int else None for h in e.hashes]
        m = len(hs)
        if e.kind == _STORED:
            if e.block_size != block_size:
                wrong_block_size += 1
            elif len(e.tokens) != m * block_size * 8:
                malformed += 1
            else:
                if e.parent is not None:
                    if e.extra and ns:
                        break  # the parent's namespace decides: KvIndexer's own path
                    ph = hash64(e.parent)
                    if ph in km:
                        h = km[ph]
                    elif d > 0 and type(e.parent) is int and index._has(wrap_int64(e.parent), c):
                        h = wrap_int64(e.parent)
                    elif not alone:
                        break  # another tier may hold the parent
                    else:
                        unknown_parent += 1
                        ev += 1
                        continue
                else:
                    h = seed
                if m == 0:
                    ev += 1
                    continue
                keys = page_hash_chain(h, e.tokens, block_size * 8)
                identity = all(own[k] == keys[k] for k in range(m))
                if identity and not km:
                    st = 0
                    for key in keys:
                        if index._has(key, c):
                            duplicates += 1
                        else:
                            index._hold(key, c)
                            st += 1
                    stored += st
                    d += st
                elif not identity and d == 0:
                    if len(set(hs)) == m and km.keys().isdisjoint(hs):
                        for k in range(m):
                            km[hs[k]] = keys[k]
                            index._hold(keys[k], c)
                        stored += m
                    else:
                        if any(own[k] == keys[k] for k in range(m)):
                            break  # a block under its own key among others
                        for k in range(m):  # one at a time: duplicates, moved hashes
                            known = km.get(hs[k])
                            if known is not None:
                                if known == keys[k]:
                                    duplicates += 1
                                    continue
                                del km[hs[k]]
                                index._drop(known, c)
                            km[hs[k]] = keys[k]
                            index._hold(keys[k], c)
                            stored += 1
                else:
                    break  # both ways: KvIndexer's own path
        else:  # removed
            if not km and d == 0:
                unknown_removals += m  # the copy holds nothing
            elif km:
                for k in range(m):
                    known = km.pop(hs[k], None)
                    if known is None:
                        unknown_removals += 1
                    else:
                        index._drop(known, c)
                        removed += 1
            else:
                st = 0
                for k in range(m):
                    if own[k] is not None and index._drop(own[k], c):
                        st += 1
                    else:
                        unknown_removals += 1
                removed += st
                d -= st
        ev += 1
    return (ev, stored, duplicates, removed, unknown_removals, unknown_parent,
            wrong_block_size, malformed, d)


# -- a subscriber's stream (see the module docstring) ---------------------------------------
def recv_stream(handle: Any, limit: Any, expected: Any) -> Any:
    """A subscriber's stream messages read without waiting, through pyzmq; see the module
    docstring."""
    if type(handle) is not int or type(limit) is not int or type(expected) is not int:
        raise TypeError("handle, limit and expected must be ints")
    if not 0 < handle < 2 ** 64:
        raise ValueError(f"handle must be a socket's address, got {handle}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if not 0 <= expected < 2 ** 63:
        raise ValueError(f"expected must be in [0, 2**63), got {expected}")
    import zmq

    sock = zmq.Socket.shadow(handle)
    recv, flags, again = sock.recv, zmq.NOBLOCK, zmq.Again
    payloads: list = []
    malformed = error = 0
    last = None
    while len(payloads) < limit:
        try:
            frame = recv(flags, copy=False)
            frames, seq, data = 1, -1, None
            while frame.more:  # a message arrives whole: its other frames are there
                frame = recv(flags, copy=False)
                frames += 1
                if frames == 2 and len(frame) == 8:
                    seq = int.from_bytes(frame.bytes, "big", signed=True)
                elif frames == 3:
                    data = frame.bytes
        except again:
            break
        except zmq.ZMQError as exc:
            error = int(exc.errno or -1)  # an int, as the compiled module's
            break
        if frames != 3 or seq < 0:
            malformed += 1
            continue
        if seq != expected:
            last = (seq, data)
            break
        payloads.append(data)
        expected += 1
    return payloads, malformed, last, error
