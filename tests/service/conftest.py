"""The ``service`` fixture: ``radixcache serve`` processes a test starts, each stopped with
SIGTERM afterwards, which must end it cleanly (exit code 0)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# This folder is a package (see __init__.py): its test modules import their helpers by name.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def service():
    from service_helpers import Service

    made = []

    def start(*args: str, **kwargs):
        made.append(Service(*args, **kwargs))
        return made[-1]

    yield start
    for svc in made:
        assert svc.stop() == 0, svc.output()  # SIGTERM: a clean stop
