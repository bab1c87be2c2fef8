"""``Request``: one prompt and its output, as the serving loop replays it and a trace makes it.

Token ids of prompts must lie in ``[0, FRESH_TOKEN_BASE)``: the serving loop numbers the fresh
output tokens it generates from ``FRESH_TOKEN_BASE`` up, so they never equal a prompt token.

``trusted_request`` makes a ``Request`` from arrays already checked (a parsed trace's) without
a pass over the tokens; it may hand the serving loop a buffer to build prompt + output in
(``take_buffer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validate import check_int, check_real, counted

__all__ = ["FRESH_TOKEN_BASE", "Request", "take_buffer", "trusted_request"]

#: First id of the output tokens ``serve`` generates; prompt tokens stay below it.
FRESH_TOKEN_BASE = 1 << 62


def _token_array(tokens: Any, what: str) -> np.ndarray:
    """``tokens`` as a 1-D int64 numpy array (no copy when it already is one)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got {arr.ndim}-D")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= FRESH_TOKEN_BASE:
        raise ValueError(f"{what} token ids must lie in [0, 2**62)")
    return np.ascontiguousarray(arr, dtype=np.int64)


@dataclass(frozen=True, eq=False)  # eq=False: numpy fields make field-wise == ambiguous
class Request:
    """One request: ``prompt`` tokens, then ``output_len`` generated tokens.

    Attributes:
        prompt: The prompt's token ids, a 1-D int64 numpy array (ids in ``[0, 2**62)``).
        output_len: How many tokens the request generates, an int >= 0.
        output: The generated tokens when they are fixed (a chat's next turn quotes them);
            None: the serving loop generates ``output_len`` fresh tokens that match nothing
            else.
        extra_key: The namespace the request's tokens are cached in (None: the default).
        timestamp: When it arrives, in ms (optional; only the fleet simulation uses it).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a prompt or output that is not 1-D or has ids outside ``[0, 2**62)``,
            a negative ``output_len``, an ``output`` whose length is not ``output_len``, or
            a negative or infinite ``timestamp``.
    """

    # ``_buffer`` is not a field: only ``trusted_request`` sets it, ``take_buffer`` takes it,
    # and a copy or pickle of the request never carries it (``__getstate__``).
    __slots__ = ("__dict__", "__weakref__", "_buffer")

    prompt: np.ndarray
    output_len: int
    output: np.ndarray | None = None
    extra_key: object = None
    timestamp: float | None = None  # arrival time in ms (traces that carry one)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", _token_array(self.prompt, "prompt"))
        object.__setattr__(self, "output_len", check_int(self.output_len, "output_len", low=0))
        if self.output is not None:
            output = _token_array(self.output, "output")
            if len(output) != self.output_len:
                raise ValueError(
                    f"output has {counted(len(output), 'token')} but output_len is "
                    f"{self.output_len}")
            object.__setattr__(self, "output", output)
        if self.timestamp is not None:
            object.__setattr__(self, "timestamp", check_real(self.timestamp, "timestamp", low=0))

    def __getstate__(self) -> dict:
        # The fields only: a buffer that ``trusted_request`` gave stays with this object.
        return self.__dict__


def trusted_request(prompt: np.ndarray, output_len: int, output: np.ndarray | None = None,
                    extra_key: object = None, timestamp: float | None = None, *,
                    buffer: np.ndarray | None = None) -> Request:
    """Make a ``Request`` from values already checked and converted, with no pass over the
    tokens (a parsed trace's requests).

    Nothing is checked: the caller vouches for what ``Request`` checks and converts.

    Args:
        prompt: A 1-D int64 numpy array of ids in ``[0, FRESH_TOKEN_BASE)``.
        output_len: An int >= 0.
        output: None, or a 1-D int64 numpy array of ``output_len`` ids in
            ``[0, FRESH_TOKEN_BASE)``.
        extra_key: The namespace (None: the default).
        timestamp: A float >= 0 (ms), or None.
        buffer: None, or a writable int64 array that starts with the prompt (``prompt`` is
            ``buffer[:len(prompt)]``) and has room for the output after it: the serving loop
            that admits the request first (``take_buffer``) writes the generated output
            there instead of copying the prompt. Nothing else may use the buffer's tail
            while the request is served.

    Returns:
        The ``Request``.
    """
    request = object.__new__(Request)
    set_field = object.__setattr__
    set_field(request, "prompt", prompt)
    set_field(request, "output_len", output_len)
    set_field(request, "output", output)
    set_field(request, "extra_key", extra_key)
    set_field(request, "timestamp", timestamp)
    set_field(request, "_buffer", buffer)
    return request


def take_buffer(request: Request) -> np.ndarray | None:
    """Take the buffer ``trusted_request`` gave ``request``: the first call gets it, later
    ones None, so that of two admissions of the same request only one writes to it.

    Args:
        request: The ``Request``.

    Returns:
        The buffer (see ``trusted_request``), or None: the request has none, or it was taken.
    """
    buffer = getattr(request, "_buffer", None)
    if buffer is not None:
        object.__setattr__(request, "_buffer", None)
    return buffer
