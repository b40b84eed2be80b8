"""Shared fixtures: real models (pulled once into KVLAB_HOME) and tiny random models."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def real_model():
    """Return a function name -> path of the assembled .gguf, pulling it on first use."""
    from kvlab import hub

    def get(name: str):
        return hub.pull(name, quiet=True)

    return get
