"""Fixtures of the Endpoint Picker's tests: the test model's tokenizer directories (what each
needs installed is checked by ``epp_support.require``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# This folder is a package (see __init__.py): its modules import each other by name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from epp_support import require


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
