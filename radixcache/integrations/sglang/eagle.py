"""EAGLE's bigram keys on radixcache's tree, unchanged.

With EAGLE-family speculative decoding (EAGLE, EAGLE3, NEXTN/MTP, FROZEN_KV_MTP: SGLang's
``is_eagle``) SGLang keys its cache by token pairs: raw tokens ``t0 .. t(N-1)`` are the ``N-1``
bigrams ``(t0, t1) .. (t(N-2), t(N-1))``, bigram ``i`` holding the KV slot of raw token ``i``.
Two sequences share a bigram prefix of length ``k`` exactly when they share a raw prefix of
``k+1`` tokens. So the tree keeps, for each sequence, the raw tokens ``t1 .. t(N-1)`` (each
standing for the bigram that ends in it) in a namespace of the first token ``t0`` and the key's
own namespace: every match, page (``page_size`` bigrams) and split falls where SGLang's bigram
tree puts it, the tree core needs no change and the plain path none either.

``shift`` below is 1 for a bigram cache (the tree's tokens start one raw token in) and 0 for a
plain one, so that one code path serves both.
"""

from __future__ import annotations

from array import array
from typing import Any, Optional

from sglang.srt.mem_cache.radix_cache import RadixKey

__all__ = ["bigram_namespace", "event_key"]


def bigram_namespace(extra_key: Any, salt: Optional[str], first: int) -> Any:
    """The tree namespace of a bigram sequence whose first raw token is ``first``: the int
    itself in the default namespace, else a 3-tuple (no key of another kind equals either)."""
    if extra_key is None and salt is None:
        return first
    return (extra_key, salt, first)


def event_key(tokens: Any, start: int, before: Optional[int], extra_key: Any,
              salt: Optional[str]) -> RadixKey:
    """The key SGLang's event recorder reads for a new leaf holding ``tokens[start:]`` (an
    int64 numpy array of the tree's tokens): plain ids, or with ``before`` (a bigram cache's
    first raw token) the leaf's raw tokens as a bigram key -- its first bigram begins with the
    token before the leaf, ``tokens[start - 1]``, or ``before`` at the root."""
    if before is None:
        return RadixKey(array("q", tokens[start:].tobytes()), extra_key, cache_salt=salt)
    raw = array("q", [before if start == 0 else int(tokens[start - 1])])
    raw.frombytes(tokens[start:].tobytes())
    return RadixKey(raw, extra_key, is_bigram=True, cache_salt=salt)
