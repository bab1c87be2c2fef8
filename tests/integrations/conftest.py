"""The SGLang backend's tests: the tree core each differential runs ours on."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["c", "python"])
def backend_core(request) -> str:
    """A radixcache tree core to build the backend on (skips one this build lacks)."""
    from radixcache._core import CORES

    if request.param not in CORES:
        pytest.skip(f"the {request.param!r} core is not available in this build")
    return request.param
