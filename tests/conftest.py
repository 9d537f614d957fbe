"""Shared fixtures: the Megatron reference runs, computed once per test session."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when a kernel is decorated, and without a GPU its
    # interpreter is the only way a kernel runs: set before any test file imports one, since
    # a file that sets it as it is collected may come after one that imports the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tknp_workers import SCENARIOS, SEED, reference_worker
from tknp_megatron.launch import spawn


@pytest.fixture(scope="session")
def reference(tmp_path_factory, worker_id):
    """Scenario name -> (reference outputs, K/V of prompt[:-1] or None).

    Computed once per run (18 s of CPU): under pytest-xdist the first test process to ask
    computes it into the processes' shared temporary folder, and the other reads it there."""
    if worker_id == "master":
        return spawn(reference_worker, 1, (SCENARIOS, SEED), timeout_s=300)[0]
    import torch
    from filelock import FileLock

    path = tmp_path_factory.getbasetemp().parent / "reference.pt"
    with FileLock(f"{path}.lock", timeout=600):
        if not path.is_file():
            torch.save(spawn(reference_worker, 1, (SCENARIOS, SEED), timeout_s=300)[0], path)
        return torch.load(path, weights_only=False)


# The files that take longest on a 2-core machine (each 1.5-3 minutes in a run of
# 2026-12-03), run first: `make test` spreads whole files over two processes, and a long
# file that starts last keeps one process busy after the other has finished.
SLOW_FIRST = ("test_dcp.py", "test_megatron_versions.py", "test_trained_model.py", "test_multi_host.py", "test_attention_triton.py",
              "test_server.py", "test_tknp_decode.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: files keep their order
