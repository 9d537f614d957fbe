"""Shared fixtures: the Megatron reference runs, computed once per test session."""

import pytest

from tests.tknp_workers import SCENARIOS, SEED, reference_worker
from tknp_megatron.launch import spawn


@pytest.fixture(scope="session")
def reference():
    """Scenario name -> (reference outputs, K/V of prompt[:-1] or None)."""
    return spawn(reference_worker, 1, (SCENARIOS, SEED), timeout_s=300)[0]
