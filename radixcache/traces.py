"""Request traces from JSONL files, the format detected per file from its first non-empty line.

Mooncake (FAST'25) traces: ``{"timestamp": T, "input_length": N, "output_length": M,
"hash_ids": [...]}`` (other keys are ignored). Each hash id stands for one block of ``block_size``
tokens; the tokens of id ``h`` are ``h * block_size + arange(block_size)``, so equal ids mean
equal tokens, and the prompt is the blocks' tokens cut to ``input_length``. The output is
``output_length`` fresh tokens.

Token-id traces: ``{"prompt": [ids], "output": [ids]}`` or ``{"prompt": [ids],
"output_length": M}``, with an optional ``"extra_key"`` (string, int or null) that separates
cache namespaces (e.g. LoRA adapters).

Both formats may carry ``"timestamp"``: the arrival time in ms (a non-negative number), used
by the fleet simulation (``radixcache simulate --workers N``); the single-cache replay
ignores it.

Token ids must lie in ``[0, 2**62)``: the serving loop numbers fresh output tokens from
``2**62`` up, so they never collide with a trace's tokens. Any problem raises ``TraceError``
with ``FILE:LINE: what is wrong``.

``read_trace`` returns a ``Trace``: a sequence of ``Request`` whose memory is proportional to
the file, not to the tokens it stands for. A Mooncake trace keeps its block ids and lengths in
a few arrays and makes a request's tokens only when the request is read (``trace[i]`` or
iteration); a token-id trace keeps every prompt in one int64 buffer (and every given output in
another). A replay therefore holds the parsed trace, the caches, and the few requests in flight.
"""

from __future__ import annotations

import array
import json
import math
import os
from collections.abc import Sequence
from typing import Any, Iterable, Iterator, List, Union

import msgspec
import numpy as np

from ._validate import is_int, is_real
from .workloads.requests import FRESH_TOKEN_BASE, Request, trusted_request

__all__ = ["TraceError", "Trace", "read_trace", "MOONCAKE", "TOKENS"]

MOONCAKE = "mooncake"
TOKENS = "tokens"

_NO_TIME = math.nan  # a request without a timestamp, in the timestamps column
_MAX_TIMESTAMP = 1e300


class TraceError(ValueError):
    """A trace file that cannot be read as requests; the message starts with ``FILE:LINE``.

    A subclass of ``ValueError``.
    """


# -- the parsed trace ------------------------------------------------------------------------------
def _readonly(arr: np.ndarray) -> np.ndarray:
    view = arr.view()
    view.setflags(write=False)
    return view


def _ragged_take(buffer: np.ndarray, offsets: np.ndarray,
                 index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The segments ``buffer[offsets[i]:offsets[i + 1]]`` for ``i`` in ``index``, packed."""
    starts = offsets[index]
    lengths = offsets[index + 1] - starts
    new_offsets = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    positions = np.arange(new_offsets[-1], dtype=np.int64)
    positions += np.repeat(starts - new_offsets[:-1], lengths)
    return buffer[positions], new_offsets


def _stamp_or_none(stamp: float) -> float | None:
    """A stored timestamp, or None for the NaN that stands for "no timestamp"."""
    return None if stamp != stamp else stamp


class Trace(Sequence):
    """The requests of a trace, kept compact: a read-only sequence of ``Request``.

    ``trace[i]`` and iteration make each request when it is read (a Mooncake request's tokens
    are computed from its block ids then), so a replay that drops a request after serving it
    never holds more than a few requests' tokens. Slicing gives another ``Trace``.

    Per-request columns, without making any request: ``prompt_lengths``, ``output_lengths``
    (int64 arrays) and ``timestamps`` (float64, ms; NaN for a request without one). Totals:
    ``prompt_tokens``, ``largest_need`` (the most slots one request takes: prompt + output) and
    ``unique_tokens``: the number of distinct prompt tokens (per ``extra_key`` namespace), which
    is what a cache holding every prompt at once would hold. For a Mooncake trace that is, over
    the distinct hash ids, the block size each, except that a block only ever used as some
    prompt's cut last block counts the most of its tokens any prompt uses.

    ``Trace.from_requests(requests)`` packs any requests into one; ``read_trace`` makes one
    from a file. The constructor is the shared base of the concrete kinds.

    Args:
        prompt_lengths: Prompt tokens of each request (int64 array).
        output_lengths: Output tokens of each request (int64 array).
        timestamps: Arrival time of each request in ms (float64 array; NaN: none given).
    """

    kind: str

    def __init__(self, prompt_lengths: np.ndarray, output_lengths: np.ndarray,
                 timestamps: np.ndarray) -> None:
        self._prompt_lengths = _readonly(prompt_lengths)
        self._output_lengths = _readonly(output_lengths)
        self._timestamps = _readonly(timestamps)
        self._unique: int | None = None

    # -- sequence protocol --
    def __len__(self) -> int:
        """How many requests the trace holds.

        Returns:
            The number of requests.
        """
        return len(self._prompt_lengths)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            positions = np.arange(len(self), dtype=np.int64)[index]
            return self._take(positions, index.step in (None, 1))
        try:
            i = range(len(self))[index]
        except TypeError:
            raise TypeError(f"trace indices must be integers or slices, "
                            f"not {type(index).__name__}") from None
        return self._request(i)

    def __iter__(self) -> Iterator[Request]:
        make = self._request
        for i in range(len(self)):
            yield make(i)

    def _replay(self) -> Iterator[Request]:
        """The requests, for a caller that is done with each one before it takes the next
        (``serve``): a request's token arrays may then be overwritten by the next one's.
        ``iter(self)`` here; a kind that makes its tokens makes them into one reused buffer."""
        return iter(self)

    def __repr__(self) -> str:
        return (f"Trace({self.kind}, {len(self):,} requests, {self.prompt_tokens:,} prompt "
                f"tokens, {self.nbytes:,} bytes)")

    # -- columns and totals --
    @property
    def prompt_lengths(self) -> np.ndarray:
        """Prompt tokens of each request (read-only int64 array)."""
        return self._prompt_lengths

    @property
    def output_lengths(self) -> np.ndarray:
        """Output tokens of each request (read-only int64 array)."""
        return self._output_lengths

    @property
    def timestamps(self) -> np.ndarray:
        """Arrival time of each request in ms (read-only float64 array; NaN: none given)."""
        return self._timestamps

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over every request."""
        return int(self._prompt_lengths.sum())

    @property
    def largest_need(self) -> int:
        """The most slots one request takes (its prompt + output); 0 for an empty trace."""
        if not len(self):
            return 0
        return int((self._prompt_lengths + self._output_lengths).max())

    @property
    def unique_tokens(self) -> int:
        """Distinct prompt tokens (per namespace); computed once, on first use."""
        if self._unique is None:
            self._unique = self._count_unique()
        return self._unique

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays that hold the trace."""
        return sum(arr.nbytes for arr in self._arrays())

    @classmethod
    def from_requests(cls, requests: Iterable[Request]) -> "Trace":
        """Pack requests into a compact token-id trace.

        Args:
            requests: ``Request`` objects, in replay order.

        Returns:
            A ``Trace`` holding their tokens in one buffer.

        Raises:
            TypeError: an item that is not a ``Request``.
        """
        builder = _TokenColumns()
        for request in requests:
            if not isinstance(request, Request):
                raise TypeError(f"requests must be Request objects, got "
                                f"{type(request).__name__}")
            builder.add(request.prompt, request.output_len, request.output, request.extra_key,
                        request.timestamp)
        return builder.trace()

    # -- per kind --
    def _request(self, i: int) -> Request:  # pragma: no cover - abstract
        raise NotImplementedError

    def _take(self, positions: np.ndarray, contiguous: bool) -> "Trace":  # pragma: no cover
        raise NotImplementedError

    def _count_unique(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _arrays(self) -> list:
        return [self._prompt_lengths, self._output_lengths, self._timestamps]

    def _timestamp(self, i: int) -> float | None:
        return _stamp_or_none(float(self._timestamps[i]))


class _MooncakeTrace(Trace):
    """Block ids of every request in one int64 array (``ids[offsets[i]:offsets[i + 1]]``),
    only the blocks the prompt reaches."""

    kind = MOONCAKE

    def __init__(self, block_size: int, ids: np.ndarray, offsets: np.ndarray,
                 prompt_lengths: np.ndarray, output_lengths: np.ndarray,
                 timestamps: np.ndarray) -> None:
        super().__init__(prompt_lengths, output_lengths, timestamps)
        self.block_size = block_size
        self._ids = _readonly(ids)
        self._offsets = _readonly(offsets)
        self._block = np.arange(block_size, dtype=np.int64)

    def _request(self, i: int) -> Request:
        ids = self._ids[self._offsets[i]:self._offsets[i + 1]]
        length = int(self._prompt_lengths[i])
        output_length = int(self._output_lengths[i])
        size = len(ids) * self.block_size
        # The blocks' tokens, in a buffer with room for the output (the serving loop's).
        buffer = np.empty(max(size, length + output_length), dtype=np.int64)
        np.add((ids * self.block_size)[:, None], self._block,
               out=buffer[:size].reshape(len(ids), self.block_size))
        return trusted_request(buffer[:length], output_length, None, None, self._timestamp(i),
                               buffer=buffer)

    def _runs(self, first: int, last: int) -> tuple[np.ndarray, list]:
        """Requests ``first`` to ``last - 1``'s blocks as runs of consecutive ids, whose
        tokens are one range each: a row per run (its first token's place in its request,
        its tokens, its first token), and where each request's rows start."""
        offsets = self._offsets[first:last + 1]
        ids = self._ids[offsets[0]:offsets[-1]]
        offsets = offsets - offsets[0]
        block_size = self.block_size
        starts_here = np.ones(len(ids), dtype=bool)
        if len(ids) > 1:
            np.not_equal(ids[1:], ids[:-1] + 1, out=starts_here[1:])
        starts_here[offsets[:-1][offsets[:-1] < len(ids)]] = True  # a request's first block
        starts = np.flatnonzero(starts_here)
        owner = np.searchsorted(offsets, starts, side="right") - 1
        table = np.empty((len(starts), 3), dtype=np.int64)
        table[:, 0] = (starts - offsets[owner]) * block_size
        table[:, 1] = np.diff(np.append(starts, len(ids))) * block_size
        table[:, 2] = ids[starts] * block_size
        return table, np.searchsorted(starts, offsets).tolist()

    def _replay(self) -> Iterator[Request]:
        # One buffer for every request, written while it is still in the CPU's caches (no
        # allocation, no fresh pages), a run of consecutive block ids at a time: its tokens
        # are one range, a shared arange plus its first token, in one flat pass. The
        # requests' numbers are read as Python lists, a chunk at a time.
        if not len(self):
            return
        block_size = self.block_size
        blocks = np.diff(self._offsets)
        ramp = np.arange(int(blocks.max()) * block_size, dtype=np.int64)
        buffer = np.empty(max(len(ramp), self.largest_need), dtype=np.int64)
        add = np.add
        chunk = 4096
        for first in range(0, len(self), chunk):
            last = min(first + chunk, len(self))
            runs, run_starts = self._runs(first, last)
            lengths = self._prompt_lengths[first:last].tolist()
            output_lengths = self._output_lengths[first:last].tolist()
            stamps = self._timestamps[first:last].tolist()
            for i, length in enumerate(lengths):
                # (A few small lists per request, not one per run of the chunk: containers
                # that pile up set off the garbage collector.)
                for place, count, start in runs[run_starts[i]:run_starts[i + 1]].tolist():
                    add(ramp[:count], start, out=buffer[place:place + count])
                yield trusted_request(buffer[:length], output_lengths[i], None, None,
                                      _stamp_or_none(stamps[i]), buffer=buffer)

    def _take(self, positions: np.ndarray, contiguous: bool) -> Trace:
        if contiguous and len(positions):
            first, last = int(positions[0]), int(positions[-1]) + 1
            ids = self._ids[self._offsets[first]:self._offsets[last]]
            offsets = self._offsets[first:last + 1] - self._offsets[first]
        else:
            ids, offsets = _ragged_take(self._ids, self._offsets, positions)
        return _MooncakeTrace(self.block_size, ids, offsets, self._prompt_lengths[positions],
                              self._output_lengths[positions], self._timestamps[positions])

    def _count_unique(self) -> int:
        ids = self._ids
        if not len(ids):
            return 0
        blocks = np.diff(self._offsets)
        used = np.full(len(ids), self.block_size, dtype=np.int64)
        some = blocks > 0
        # A prompt's last block holds what is left of it: at most block_size tokens.
        used[self._offsets[1:][some] - 1] = (self._prompt_lengths[some]
                                             - (blocks[some] - 1) * self.block_size)
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
        return int(np.maximum.reduceat(used[order], starts).sum())

    def _arrays(self) -> list:
        return super()._arrays() + [self._ids, self._offsets]


class _TokenTrace(Trace):
    """Every prompt in one int64 buffer, every given output in another (with offsets), the
    extra keys as an index into their distinct values (-1: None)."""

    kind = TOKENS

    def __init__(self, prompts: np.ndarray, prompt_offsets: np.ndarray, outputs: np.ndarray,
                 output_offsets: np.ndarray, has_output: np.ndarray, keys: tuple,
                 key_index: np.ndarray, output_lengths: np.ndarray,
                 timestamps: np.ndarray) -> None:
        super().__init__(np.diff(prompt_offsets), output_lengths, timestamps)
        self._prompts = _readonly(prompts)
        self._prompt_offsets = _readonly(prompt_offsets)
        self._outputs = _readonly(outputs)
        self._output_offsets = _readonly(output_offsets)
        self._has_output = _readonly(has_output)
        self._keys = keys
        self._key_index = _readonly(key_index)

    def _request(self, i: int) -> Request:
        prompt = self._prompts[self._prompt_offsets[i]:self._prompt_offsets[i + 1]]
        output = None
        if self._has_output[i]:
            output = self._outputs[self._output_offsets[i]:self._output_offsets[i + 1]]
        key = int(self._key_index[i])
        return trusted_request(prompt, int(self._output_lengths[i]), output,
                               None if key < 0 else self._keys[key], self._timestamp(i))

    def _take(self, positions: np.ndarray, contiguous: bool) -> Trace:
        if contiguous and len(positions):
            first, last = int(positions[0]), int(positions[-1]) + 1
            po, oo = self._prompt_offsets, self._output_offsets
            prompts = self._prompts[po[first]:po[last]]
            prompt_offsets = po[first:last + 1] - po[first]
            outputs = self._outputs[oo[first]:oo[last]]
            output_offsets = oo[first:last + 1] - oo[first]
        else:
            prompts, prompt_offsets = _ragged_take(self._prompts, self._prompt_offsets, positions)
            outputs, output_offsets = _ragged_take(self._outputs, self._output_offsets, positions)
        return _TokenTrace(prompts, prompt_offsets, outputs, output_offsets,
                           self._has_output[positions], self._keys,
                           self._key_index[positions], self._output_lengths[positions],
                           self._timestamps[positions])

    def _count_unique(self) -> int:
        if not len(self._prompts):
            return 0
        if not self._keys:
            return int(len(np.unique(self._prompts)))
        labels = np.repeat(self._key_index, self._prompt_lengths)
        return sum(int(len(np.unique(self._prompts[labels == key])))
                   for key in np.unique(labels))

    def _arrays(self) -> list:
        return super()._arrays() + [self._prompts, self._prompt_offsets, self._outputs,
                                    self._output_offsets, self._has_output, self._key_index]


# -- building the columns -------------------------------------------------------------------------
def _int64(values: array.array) -> np.ndarray:
    return np.frombuffer(values, dtype=np.int64) if len(values) else np.empty(0, np.int64)


def _offsets(ends: array.array) -> np.ndarray:
    offsets = np.zeros(len(ends) + 1, dtype=np.int64)
    offsets[1:] = _int64(ends)
    return offsets


def _timestamps_ok(stamps: np.ndarray) -> bool:
    given = stamps[~np.isnan(stamps)]
    return not len(given) or bool(given.min() >= 0 and given.max() < _MAX_TIMESTAMP)


def _ids_ok(values: np.ndarray, upper: int) -> bool:
    return not len(values) or bool(values.min() >= 0 and values.max() < upper)


class _Fallback(Exception):
    """The fast path met something it does not check itself: parse again, line by line."""


class _MooncakeColumns:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.max_id = FRESH_TOKEN_BASE // block_size  # every block's tokens stay below 2**62
        self.ids = array.array("q")
        self.ends = array.array("q")
        self.input_lengths = array.array("q")
        self.output_lengths = array.array("q")
        self.timestamps = array.array("d")
        # Ids past the blocks a prompt reaches are not kept, but they are checked too.
        self.dropped_low, self.dropped_high = 0, -1

    def add(self, ids: Any, input_length: int, output_length: int,
            timestamp: float | None) -> None:
        """One checked row (``ids`` already cut to the blocks the prompt reaches)."""
        self.ids.frombytes(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        self.ends.append(len(self.ids))
        self.input_lengths.append(input_length)
        self.output_lengths.append(output_length)
        self.timestamps.append(_NO_TIME if timestamp is None else timestamp)

    def add_fast(self, line: Any) -> None:
        """One row from the typed decoder; anything it cannot vouch for raises _Fallback."""
        ids, input_length, output_length = line.hash_ids, line.input_length, line.output_length
        if input_length < 0 or output_length < 0:
            raise _Fallback
        need = -(-input_length // self.block_size)
        if need > len(ids):
            raise _Fallback
        if need < len(ids):
            rest = ids[need:]
            self.dropped_low = min(self.dropped_low, min(rest))
            self.dropped_high = max(self.dropped_high, max(rest))
            ids = ids[:need]
        self.ids.extend(ids)  # OverflowError past int64
        self.ends.append(len(self.ids))
        self.input_lengths.append(input_length)
        self.output_lengths.append(output_length)
        stamp = line.timestamp
        self.timestamps.append(_NO_TIME if stamp is msgspec.UNSET else stamp)

    def check_fast(self) -> None:
        if (not _ids_ok(_int64(self.ids), self.max_id) or self.dropped_low < 0
                or self.dropped_high >= self.max_id
                or not _timestamps_ok(np.frombuffer(self.timestamps, dtype=np.float64))):
            raise _Fallback

    def trace(self) -> Trace:
        return _MooncakeTrace(self.block_size, _int64(self.ids), _offsets(self.ends),
                              _int64(self.input_lengths), _int64(self.output_lengths),
                              np.array(self.timestamps, dtype=np.float64))


class _TokenColumns:
    def __init__(self) -> None:
        self.prompts = array.array("q")
        self.prompt_ends = array.array("q")
        self.outputs = array.array("q")
        self.output_ends = array.array("q")
        self.has_output = array.array("b")
        self.output_lengths = array.array("q")
        self.key_index = array.array("q")
        self.keys: dict = {}  # (type, key) -> index: 1 and True stay distinct keys
        self.timestamps = array.array("d")

    def _key(self, extra_key: Any) -> int:
        if extra_key is None:
            return -1
        return self.keys.setdefault((type(extra_key), extra_key), len(self.keys))

    def add(self, prompt: Any, output_len: int, output: Any, extra_key: Any,
            timestamp: float | None) -> None:
        """One checked request (token arrays as int64 numpy arrays)."""
        self.prompts.frombytes(np.ascontiguousarray(prompt, dtype=np.int64).tobytes())
        self.prompt_ends.append(len(self.prompts))
        if output is not None:
            self.outputs.frombytes(np.ascontiguousarray(output, dtype=np.int64).tobytes())
        self.output_ends.append(len(self.outputs))
        self.has_output.append(output is not None)
        self.output_lengths.append(output_len)
        self.key_index.append(self._key(extra_key))
        self.timestamps.append(_NO_TIME if timestamp is None else timestamp)

    def add_fast(self, line: Any) -> None:
        unset = msgspec.UNSET
        output, output_length = line.output, line.output_length
        if output is unset:
            if output_length is unset or output_length < 0:
                raise _Fallback
            has_output = False
        else:
            if output_length is not unset and output_length != len(output):
                raise _Fallback
            output_length = len(output)
            self.outputs.extend(output)
            has_output = True
        self.prompts.extend(line.prompt)
        self.prompt_ends.append(len(self.prompts))
        self.output_ends.append(len(self.outputs))
        self.has_output.append(has_output)
        self.output_lengths.append(output_length)
        self.key_index.append(self._key(line.extra_key))
        stamp = line.timestamp
        self.timestamps.append(_NO_TIME if stamp is unset else stamp)

    def check_fast(self) -> None:
        if (not _ids_ok(_int64(self.prompts), FRESH_TOKEN_BASE)
                or not _ids_ok(_int64(self.outputs), FRESH_TOKEN_BASE)
                or not _timestamps_ok(np.frombuffer(self.timestamps, dtype=np.float64))):
            raise _Fallback

    def trace(self) -> Trace:
        keys = tuple(key for _type, key in self.keys)
        return _TokenTrace(_int64(self.prompts), _offsets(self.prompt_ends), _int64(self.outputs),
                           _offsets(self.output_ends),
                           np.frombuffer(self.has_output, dtype=np.int8).astype(bool)
                           if len(self.has_output) else np.empty(0, dtype=bool),
                           keys, _int64(self.key_index), _int64(self.output_lengths),
                           np.array(self.timestamps, dtype=np.float64))


# Typed decoders of the fast path: msgspec checks the types, the columns check the values.
class _MooncakeLine(msgspec.Struct):
    hash_ids: List[int]
    input_length: int
    output_length: int
    timestamp: Union[float, msgspec.UnsetType] = msgspec.UNSET


class _TokenLine(msgspec.Struct):
    prompt: List[int]
    output: Union[List[int], msgspec.UnsetType] = msgspec.UNSET
    output_length: Union[int, msgspec.UnsetType] = msgspec.UNSET
    extra_key: Union[str, int, None] = None
    timestamp: Union[float, msgspec.UnsetType] = msgspec.UNSET


_DECODERS = {MOONCAKE: msgspec.json.Decoder(_MooncakeLine),
             TOKENS: msgspec.json.Decoder(_TokenLine)}


# -- the checked, line-by-line path ----------------------------------------------------------------
def _is_int(value: Any) -> bool:
    # A JSON value: exactly int (true/false parse as bool, an int subclass: not tokens). Per
    # token, so a type test rather than _validate.is_int's ABC check (ten times slower).
    return type(value) is int


def _int_field(record: dict, name: str, where: str) -> int:
    if name not in record:
        raise TraceError(f"{where}: missing field {name!r}")
    value = record[name]
    if not _is_int(value) or value < 0:
        raise TraceError(f"{where}: {name!r} must be a non-negative integer, got {value!r}")
    return value


def _id_list(record: dict, name: str, where: str, upper: int) -> np.ndarray:
    """A JSON list of ints in ``[0, upper)`` as an int64 array."""
    if name not in record:
        raise TraceError(f"{where}: missing field {name!r}")
    values = record[name]
    if not isinstance(values, list):
        raise TraceError(f"{where}: {name!r} must be a list of integers, "
                         f"got {type(values).__name__}")
    for value in values:
        if not _is_int(value) or not 0 <= value < upper:
            raise TraceError(f"{where}: {name!r} holds {value!r}; expected integers in "
                             f"[0, {upper})")
    return np.array(values, dtype=np.int64)


def _timestamp(record: dict, where: str) -> float | None:
    if "timestamp" not in record:
        return None
    value = record["timestamp"]
    if not is_real(value) or not 0 <= value < _MAX_TIMESTAMP:
        raise TraceError(f"{where}: 'timestamp' must be a non-negative number of ms, "
                         f"got {value!r}")
    return float(value)


def _detect(record: dict) -> str | None:
    if "hash_ids" in record:
        return MOONCAKE
    if "prompt" in record:
        return TOKENS
    return None


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _decode_checked(raw: bytes, where: str) -> dict:
    """One line as a JSON object, or TraceError: ``FILE:LINE: not valid JSON: reason``."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON: not UTF-8 text (byte {exc.start + 1} of "
                         "the line)") from None
    text = text.rstrip()
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        reason = _lower_first(exc.msg)
        if exc.pos >= len(text):
            reason += " at the end of the line"
        else:
            reason += f" at column {exc.pos + 1}"
        raise TraceError(f"{where}: not valid JSON: {reason}") from None
    except RecursionError:
        raise TraceError(f"{where}: not valid JSON: nested too deeply") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _add_checked_tokens(columns: _TokenColumns, record: dict, where: str) -> None:
    prompt = _id_list(record, "prompt", where, FRESH_TOKEN_BASE)
    output = None
    if "output" in record:
        output = _id_list(record, "output", where, FRESH_TOKEN_BASE)
        output_len = len(output)
        if "output_length" in record and _int_field(record, "output_length", where) != output_len:
            raise TraceError(f"{where}: 'output_length' is {record['output_length']} but "
                             f"'output' has {output_len} tokens")
    elif "output_length" in record:
        output_len = _int_field(record, "output_length", where)
    else:
        raise TraceError(f"{where}: missing field 'output' or 'output_length'")
    extra_key = record.get("extra_key")
    if extra_key is not None and not isinstance(extra_key, (str, int)):
        raise TraceError(f"{where}: 'extra_key' must be a string, an integer or null")
    columns.add(prompt, output_len, output, extra_key, _timestamp(record, where))


def _add_checked_mooncake(columns: _MooncakeColumns, record: dict, where: str) -> None:
    block_size = columns.block_size
    hash_ids = _id_list(record, "hash_ids", where, columns.max_id)
    input_length = _int_field(record, "input_length", where)
    output_length = _int_field(record, "output_length", where)
    if input_length > len(hash_ids) * block_size:
        raise TraceError(
            f"{where}: input_length {input_length} needs {-(-input_length // block_size)} "
            f"blocks of {block_size} tokens but hash_ids has {len(hash_ids)} "
            "(wrong --block-size?)"
        )
    # Only the blocks that input_length reaches matter.
    columns.add(hash_ids[: -(-input_length // block_size)], input_length, output_length,
                _timestamp(record, where))


def _parse(path: Any, name: str, block_size: int, limit: int | None, fast: bool) -> Trace:
    kind = None
    columns: Any = None
    add_checked: Any = None
    decode: Any = None
    count = 0
    with open(path, "rb") as stream:
        for lineno, raw in enumerate(stream, 1):
            if limit is not None and count >= limit:
                break
            if not raw.strip():
                continue
            if kind is not None and fast:
                try:
                    columns.add_fast(decode(raw))
                except (msgspec.MsgspecError, OverflowError, ValueError, TypeError):
                    raise _Fallback from None
            else:
                where = f"{name}:{lineno}"
                record = _decode_checked(raw, where)
                if kind is None:
                    kind = _detect(record)
                    if kind is None:
                        raise TraceError(
                            f"{where}: unknown trace format: expected a 'hash_ids' field "
                            "(Mooncake) or a 'prompt' field (token ids)"
                        )
                    if kind == MOONCAKE:
                        columns, add_checked = _MooncakeColumns(block_size), _add_checked_mooncake
                    else:
                        columns, add_checked = _TokenColumns(), _add_checked_tokens
                    decode = _DECODERS[kind].decode
                add_checked(columns, record, where)
            count += 1
    if kind is None:
        if limit != 0:
            raise TraceError(f"{name}: no requests (the file is empty)")
        return _TokenColumns().trace()
    if fast:
        columns.check_fast()
    return columns.trace()


def read_trace(path: str | os.PathLike, block_size: int = 512,
               limit: int | None = None) -> Trace:
    """Read the requests of a JSONL trace, Mooncake or token ids (see the module docstring).

    The format is detected from the first non-empty line.

    Args:
        path: The trace file.
        block_size: Tokens per hash id in Mooncake traces, an int >= 1 (default 512).
        limit: Read at most this many requests (None: all).

    Returns:
        A ``Trace``: a read-only sequence of ``Request`` in file order, kept compact (each
        request is made when it is read).

    Raises:
        TraceError: malformed content (a ``ValueError`` whose message starts with
            ``FILE:LINE``).
        ValueError: a ``block_size`` or ``limit`` that is not a valid int.
        OSError: the file cannot be read.
    """
    # A ValueError for a wrong type too: a bad setting (see Raises).
    if not is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if limit is not None and (not is_int(limit) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    block_size, limit = int(block_size), None if limit is None else int(limit)
    name = os.fspath(path)
    try:
        return _parse(path, name, block_size, limit, fast=True)
    except _Fallback:
        # Something only the checked path describes (or accepts): every line again, checked.
        return _parse(path, name, block_size, limit, fast=False)
