"""Asking for ``tknp-dual`` where two weight copies do not pay: the run falls back to
single-copy TKNP and says so in one line, unless forced (tknp_megatron/analysis/dual_choice.py,
``bench_serving --force-dual``).

(a) The policy's mode, run on a real gloo pool, gives the Megatron reference's tokens:
    single copy (one microbatch) by default on 2 nodes, dual active roots (both
    microbatches) when forced.
(b) The README's ``bench_serving --modes tknp-dual`` command on 2 nodes prints the
    fallback line once per trace and runs TKNP without ``--force-dual``; with it, TKNP-DUAL,
    with the same tokens.
(c) A forced dual that cannot run, and ``--force-dual`` without ``tknp-dual``: one line,
    status 2, no process started.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.helpers import assert_matches_reference, spawn_runs
from tests.tknp_workers import SCENARIOS, SEED, reference_worker, tknp_worker
from tknp_megatron.analysis import workload as wl
from tknp_megatron.analysis.dual_choice import choose_dual, dual_policy
from tknp_megatron.config import get_preset
from tknp_megatron.launch import spawn
from tknp_megatron.mode import Mode
from tknp_megatron.tools import bench_serving

WAVES = next(s for s in SCENARIOS if s.name == "llama-waves")  # tiny, 40 KV tokens a node


def _workload(s) -> wl.Workload:
    """The scenario as a trace: its prompts' and outputs' lengths, all at once."""
    reqs = [wl.WorkloadRequest(i, len(p), m, 0.0) for i, (p, m) in enumerate(zip(s.prompts, s.max_new))]
    return wl.Workload(s.name, tuple(reqs), seed=0)


def both_modes(rank, world, modes):
    """One pool serves the scenario in each of ``modes`` in turn (module level: spawn pickles it)."""
    return {(mode, key): run for mode in modes
            for key, run in tknp_worker(rank, world, [(2, 1)], [WAVES], SEED, {}, mode).items()}


def test_the_policys_mode_matches_the_reference():
    choice = choose_dual(get_preset(WAVES.preset), 2, 1, _workload(WAVES),
                         kv_tokens_per_node=WAVES.kv_tokens_per_node, block_size=WAVES.block_size)
    fallback, forced = dual_policy(choice), dual_policy(choice, force=True)
    assert not choice.dual and (fallback.mode, forced.mode) == (Mode.TKNP, Mode.TKNP_DUAL)
    reference, _ = spawn(reference_worker, 1, ([WAVES], SEED), timeout_s=300)[0][WAVES.name]
    runs = dict(spawn_runs(both_modes, {2: ((fallback.mode, forced.mode),)}))
    for policy, microbatches in ((fallback, {0}), (forced, {0, 1})):
        run = runs[(policy.mode, (2, 1, WAVES.name))]
        assert_matches_reference(run["results"], reference)
        assert run["waves"] >= 2
        assert set(run["microbatch"].values()) == microbatches, policy


def _readme_argv() -> list:
    """The README's forced ``tknp-dual`` command as argv, without ``--force-dual`` and ``--out``."""
    from tests.test_readme import commands

    (cmd,) = [shlex.split(c) for c, _ in commands() if "bench_serving --modes tknp-dual --force-dual" in c]
    argv = cmd[3:]  # python -m tknp_megatron.tools.bench_serving
    argv.remove("--force-dual")
    i = argv.index("--out")
    return argv[:i] + argv[i + 2:]


SMOKE = _readme_argv()


def _bench(tmp_path: Path, capsys, *extra: str):
    """The README's command in this process (its pool spawned); its policy lines and rows."""
    out = tmp_path / ("forced" if extra else "asked")
    assert bench_serving.main(SMOKE + list(extra) + ["--out", str(out)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("bench_serving: ")]
    return lines, json.loads((out / "results.json").read_text())["rows"]


def test_bench_serving_falls_back_unless_forced(tmp_path, capsys):
    lines, rows = _bench(tmp_path, capsys)
    assert lines == ["bench_serving: ctx=24 batch=6 rate=None: tknp-dual runs as single-copy tknp: both "
                     "copy counts hold 64 KV tokens per node (an explicit budget); predicted 0.50x single "
                     "copy (--force-dual runs two copies)"]
    assert [r["mode"] for r in rows] == ["TKNP"]
    forced_lines, forced = _bench(tmp_path, capsys, "--force-dual")
    assert len(forced_lines) == 1 and "tknp-dual runs two weight copies (--force-dual), though" in forced_lines[0]
    assert [r["mode"] for r in forced] == ["TKNP-DUAL"]
    assert forced[0]["completed"] == 6 and forced[0]["outputs"] == rows[0]["outputs"]


@pytest.mark.parametrize("argv, message", [
    (["--world", "3", "--force-dual"], "bench_serving: error: --force-dual: dual active roots need an even "
                                       "number of nodes (two copies over halves), got 3"),
])
def test_a_forced_dual_that_cannot_run_is_one_line(argv, message, capsys):
    assert bench_serving.main(SMOKE + argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]


def test_force_dual_needs_tknp_dual(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_serving.parse_args(["--modes", "tknp", "--force-dual"])
    assert exc.value.code == 2
    assert "--force-dual: only with --modes tknp-dual" in capsys.readouterr().err
