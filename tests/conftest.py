"""Session set-up: plait's cache (host profiles) lives in a temporary directory, never in the real home."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def plait_cache(tmp_path_factory):
    """``PLAIT_CACHE_DIR`` for every test and the processes it starts, holding a synthetic profile of this
    host so that ``plait train`` does not calibrate in tests that do not test calibration."""
    from plait.calibrate import CACHE_ENV, cache_path, host_facts
    from profile_util import synthetic_profile

    root = tmp_path_factory.mktemp("plait-cache")
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(root)
    facts = host_facts()
    synthetic_profile(facts).save(cache_path(facts))
    yield root
    if old is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = old
