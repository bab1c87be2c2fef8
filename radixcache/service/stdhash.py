"""The standard block hashes of the indexer API: XXH3-64 with a seed ``S`` over each
block's tokens as little-endian ``u32`` (the local hash), rolled into sequence hashes,
``seq[0] = local[0]`` and ``seq[i] = XXH3(seq[i-1]_le || local[i]_le, S)``. Needs
``xxhash`` (``pip install 'radixcache[serve]'``), imported when first used.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any, Optional

#: The seed NVIDIA Dynamo hashes blocks with, and this service's default.
DEFAULT_SEED = 1337
_U64 = (1 << 64) - 1
_PAIR = struct.Struct("<QQ")
_XXH3: list = []


def _xxh3() -> Any:
    if not _XXH3:
        try:
            from xxhash import xxh3_64_intdigest
        except ImportError:
            raise ImportError("the standard block hashes need xxhash: "
                              "pip install 'radixcache[serve]'") from None
        _XXH3.append(xxh3_64_intdigest)
    return _XXH3[0]


def u32_le(tokens: Any) -> bytes:
    """``tokens`` (ints in ``[0, 2**32)``) as little-endian ``u32`` bytes.

    Raises:
        OverflowError: a token outside ``[0, 2**32)``.
        TypeError: a token that is not an int.
    """
    if type(tokens).__name__ == "ndarray" and tokens.dtype.kind in "iu":  # a query's ids
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= 1 << 32):
            raise OverflowError("a token id outside [0, 2**32)")
        return tokens.astype("<u4").tobytes()
    data = array("I", tokens)
    if data.itemsize != 4:  # pragma: no cover - 'I' is 4 bytes on every platform we build
        data = array("L", tokens)
    if sys.byteorder != "little":  # pragma: no cover
        data.byteswap()
    return data.tobytes()


def local_hashes(tokens: Any, block_size: int, seed: int = DEFAULT_SEED) -> list:
    """The local hash (an unsigned 64-bit int) of each full block of ``tokens``."""
    xxh3 = _xxh3()
    data = memoryview(u32_le(tokens))
    step = block_size * 4
    return [xxh3(data[i:i + step], seed) for i in range(0, len(data) - step + 1, step)]


def roll(local: list, seed: int = DEFAULT_SEED, parent: Optional[int] = None) -> list:
    """The sequence hashes of blocks whose local hashes are ``local``, below the block whose
    sequence hash is ``parent`` (None: from the first block)."""
    xxh3 = _xxh3()
    pack = _PAIR.pack
    out = []
    previous = parent
    for value in local:
        previous = value if previous is None else xxh3(pack(previous, value), seed)
        out.append(previous)
    return out


def seq_hashes(tokens: Any, block_size: int, seed: int = DEFAULT_SEED) -> list:
    """The sequence hashes of the full blocks of ``tokens`` (unsigned 64-bit ints)."""
    return roll(local_hashes(tokens, block_size, seed), seed)


def unsigned(value: int) -> int:
    """A 64-bit hash as an unsigned int (a signed ``i64``, as Dynamo sends its hashes, or an
    unsigned one)."""
    return value & _U64
