"""Shared fixtures: the Megatron reference runs, computed once per test session."""

import pytest

from tests.tknp_workers import SCENARIOS, SEED, reference_worker
from tknp_megatron.launch import spawn


@pytest.fixture(scope="session")
def reference():
    """Scenario name -> (reference outputs, K/V of prompt[:-1] or None)."""
    return spawn(reference_worker, 1, (SCENARIOS, SEED), timeout_s=300)[0]


# The files that take longest on a 2-core machine (each 1.5-3 minutes in a run of
# 2026-12-03), run first: `make test` spreads whole files over two processes, and a long
# file that starts last keeps one process busy after the other has finished.
SLOW_FIRST = ("test_dcp.py", "test_trained_model.py", "test_multi_host.py", "test_attention_triton.py",
              "test_server.py", "test_tknp_decode.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: files keep their order
