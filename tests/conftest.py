"""Fixtures shared by several test modules, and the session's cache directory (never the real home)."""

from __future__ import annotations

import os

import pytest

import checks_pipeline
from harness import launch


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


@pytest.fixture(scope="session")
def world8(tmp_path_factory):
    """One launch of 8 Gloo ranks: every schedule over tp2·pp2·dp2 (tests/test_pipeline.py) and ZeRO-1/2 over
    dp2·tp2·pp2 and dp4·tp2 (tests/test_zero.py); each rank returns its dict of check results."""
    return launch(checks_pipeline.rank_main, 8, None, str(tmp_path_factory.mktemp("zero")), timeout_s=600)
