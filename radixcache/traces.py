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
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from .workloads import FRESH_TOKEN_BASE, Request

__all__ = ["TraceError", "read_trace", "MOONCAKE", "TOKENS"]

MOONCAKE = "mooncake"
TOKENS = "tokens"


class TraceError(ValueError):
    """A trace file that cannot be read as requests; the message starts with ``FILE:LINE``.

    A subclass of ``ValueError``.
    """


def _is_int(value: Any) -> bool:
    return type(value) is int  # JSON true/false parse as bool, an int subclass: not tokens


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e300:
        raise TraceError(f"{where}: 'timestamp' must be a non-negative number of ms, "
                         f"got {value!r}")
    return float(value)


def _detect(record: dict) -> str | None:
    if "hash_ids" in record:
        return MOONCAKE
    if "prompt" in record:
        return TOKENS
    return None


def _token_request(record: dict, where: str) -> Request:
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
    return Request(prompt, output_len, output, extra_key, _timestamp(record, where))


def _mooncake_row(record: dict, where: str,
                  block_size: int) -> tuple[np.ndarray, int, int, float | None]:
    max_id = FRESH_TOKEN_BASE // block_size  # every block's tokens stay below 2**62
    hash_ids = _id_list(record, "hash_ids", where, max_id)
    input_length = _int_field(record, "input_length", where)
    output_length = _int_field(record, "output_length", where)
    if input_length > len(hash_ids) * block_size:
        raise TraceError(
            f"{where}: input_length {input_length} needs {-(-input_length // block_size)} "
            f"blocks of {block_size} tokens but hash_ids has {len(hash_ids)} "
            "(wrong --block-size?)"
        )
    # Only the blocks that input_length reaches matter.
    return (hash_ids[: -(-input_length // block_size)], input_length, output_length,
            _timestamp(record, where))


def _mooncake_requests(rows: list, block_size: int) -> list[Request]:
    """Requests from parsed Mooncake rows; prompts of consecutive ids share one token array."""
    if not rows:
        return []
    total_tokens = sum(row[1] for row in rows)
    max_id = max((int(row[0].max()) for row in rows if len(row[0])), default=-1)
    shared_len = (max_id + 1) * block_size
    # One read-only arange of every block's tokens: a prompt whose ids run consecutively is a
    # view into it (most are), which keeps a long trace's memory near one copy of the tokens.
    shared = None
    if 0 < shared_len <= total_tokens:
        shared = np.arange(shared_len, dtype=np.int64)
        shared.setflags(write=False)
    offsets = np.arange(block_size, dtype=np.int64)
    requests = []
    for ids, input_length, output_length, timestamp in rows:
        if len(ids) == 0:
            prompt = np.empty(0, dtype=np.int64)
        elif shared is not None and (len(ids) == 1 or bool(np.all(np.diff(ids) == 1))):
            start = int(ids[0]) * block_size
            prompt = shared[start:start + input_length]
        else:
            prompt = (ids[:, None] * block_size + offsets).reshape(-1)[:input_length]
        requests.append(Request(prompt, output_length, timestamp=timestamp))
    return requests


def read_trace(path: str | os.PathLike, block_size: int = 512,
               limit: int | None = None) -> list[Request]:
    """Read the requests of a JSONL trace, Mooncake or token ids (see the module docstring).

    The format is detected from the first non-empty line.

    Args:
        path: The trace file.
        block_size: Tokens per hash id in Mooncake traces, an int >= 1 (default 512).
        limit: Read at most this many requests (None: all).

    Returns:
        The ``Request`` objects, in file order.

    Raises:
        TraceError: malformed content (a ``ValueError`` whose message starts with
            ``FILE:LINE``).
        ValueError: a ``block_size`` or ``limit`` that is not a valid int.
        OSError: the file cannot be read.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    name = os.fspath(path)
    kind = None
    token_requests: list[Request] = []
    mooncake_rows: list = []
    count = 0
    with open(path, "rb") as stream:
        for lineno, raw in enumerate(stream, 1):
            if limit is not None and count >= limit:
                break
            if not raw.strip():
                continue
            where = f"{name}:{lineno}"
            try:
                record = json.loads(raw)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
                raise TraceError(f"{where}: not valid JSON ({exc})") from None
            if not isinstance(record, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
            line_kind = _detect(record)
            if kind is None:
                if line_kind is None:
                    raise TraceError(
                        f"{where}: unknown trace format: expected a 'hash_ids' field (Mooncake)"
                        " or a 'prompt' field (token ids)"
                    )
                kind = line_kind
            if kind == MOONCAKE:
                mooncake_rows.append(_mooncake_row(record, where, block_size))
            else:
                token_requests.append(_token_request(record, where))
            count += 1
    if kind is None and limit != 0:
        raise TraceError(f"{name}: no requests (the file is empty)")
    if kind == MOONCAKE:
        return _mooncake_requests(mooncake_rows, block_size)
    return token_requests
