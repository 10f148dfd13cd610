"""Test isolation: an engine a test leaves attached keeps global hooks (the other-optimizer check), so detach it."""

import pytest

from fastdp import engine_registry


@pytest.fixture(autouse=True)
def _detach_leftover_engines():
    yield
    for engine in list(engine_registry._ATTACHED_ENGINES):
        engine.detach()
