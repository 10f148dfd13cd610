"""Test isolation: an engine a test leaves attached keeps global hooks (the other-optimizer check), so detach it.

Hypothesis draws the same examples on every run (profile ``repeatable``: CI on a clean clone passes or fails the
same way each time). ``FASTDP_HYPOTHESIS_PROFILE=explore`` draws fresh random examples, for runs that look for new
failures (with more examples: most fuzz suites read their count from the test; the loss trace's from
``FASTDP_FUZZ_EXAMPLES``)."""

import os

import pytest
from hypothesis import settings

from fastdp import engine_registry

settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("FASTDP_HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def _detach_leftover_engines():
    yield
    for engine in list(engine_registry._ATTACHED_ENGINES):
        engine.detach()
