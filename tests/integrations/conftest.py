"""What the SGLang integration's tests share: the tree core a backend runs on."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["c", "python"])
def backend_core(request) -> str:
    """The tree core ``RadixcacheBackend`` instances use ("c" skips where it is not built)."""
    from radixcache._core import CORES

    if request.param not in CORES:
        pytest.skip(f"the {request.param!r} core is not available in this build")
    return request.param
