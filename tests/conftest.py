"""Fixtures shared by several test modules."""

import pytest

import checks_pipeline
from harness import launch


@pytest.fixture(scope="session")
def world8(tmp_path_factory):
    """One launch of 8 Gloo ranks: every schedule over tp2·pp2·dp2 (tests/test_pipeline.py) and ZeRO-1/2 over
    dp2·tp2·pp2 and dp4·tp2 (tests/test_zero.py); each rank returns its dict of check results."""
    return launch(checks_pipeline.rank_main, 8, None, str(tmp_path_factory.mktemp("zero")), timeout_s=600)
