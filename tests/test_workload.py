"""Tests of tknp_megatron.analysis.workload: determinism, the mixed-length fit, arrivals, prompts."""

import dataclasses
import math

import numpy as np
import pytest

from tknp_megatron.analysis.workload import (
    MIXED_QUANTILES,
    PAPER_MIXED_STATS,
    Workload,
    WorkloadRequest,
    as_burst,
    fixed_length,
    mixed_length,
    mixed_length_stats,
    prompt_tokens,
    with_poisson_arrivals,
)

_LENGTH_FIELDS = ("min", "max", "mean", "median")
_SHARE_FIELDS = ("frac_above_64k_scaled", "token_share_above_64k", "token_share_top25")


def _assert_close_to_paper(stats, scale=1.0):
    paper = PAPER_MIXED_STATS.scaled(scale)
    for name in _LENGTH_FIELDS + _SHARE_FIELDS:
        assert getattr(stats, name) == pytest.approx(getattr(paper, name), rel=0.05), name
    assert stats.std == pytest.approx(paper.std, rel=0.10)


def test_fixed_length_is_a_burst_of_identical_lengths():
    w = fixed_length(16, 4096, 1024, seed=3)
    assert len(w) == w.num_requests == 16
    assert w.is_burst and w.duration_s == 0.0
    assert {(r.prompt_len, r.output_len) for r in w} == {(4096, 1024)}
    assert [r.request_id for r in w] == list(range(16))
    assert w.total_input_tokens == 16 * 4096 and w.total_output_tokens == 16 * 1024
    assert w.max_total_len == 5120
    assert w == fixed_length(16, 4096, 1024, seed=3)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_mixed_length_matches_paper_statistics(seed):
    _assert_close_to_paper(mixed_length_stats(mixed_length(2000, seed)))


def test_mixed_length_small_trace_keeps_the_long_tail():
    stats = mixed_length_stats(mixed_length(64, seed=0))
    assert stats.frac_above_64k_scaled == 0.125  # stratified: exactly 8 of 64
    _assert_close_to_paper(stats)


def test_quantile_table_moments_match_paper():
    """The exact moments of the piecewise-linear quantile function."""
    u = np.array([k for k, _ in MIXED_QUANTILES])
    q = np.array([v for _, v in MIXED_QUANTILES], dtype=float)
    du, a, b = np.diff(u), q[:-1], q[1:]
    m1, m2 = du * (a + b) / 2, du * (a * a + a * b + b * b) / 3
    mean = m1.sum()
    assert mean == pytest.approx(32_898, rel=1e-3)
    assert math.sqrt(m2.sum() - mean**2) == pytest.approx(28_496, rel=1e-3)
    assert m1[u[:-1] >= 0.875].sum() / mean == pytest.approx(0.361, rel=1e-3)
    assert m1[u[:-1] >= 0.75].sum() / mean == pytest.approx(0.572, rel=1e-3)
    assert np.all(np.diff(q) > 0)


@pytest.mark.parametrize("scale", [1 / 16, 1 / 64])
def test_mixed_length_scale_shrinks_proportionally(scale):
    w = mixed_length(2000, seed=2, scale=scale)
    assert w.scale == scale
    assert {r.output_len for r in w} == {round(1024 * scale)}
    _assert_close_to_paper(mixed_length_stats(w), scale)


def test_mixed_length_is_deterministic_and_seeded():
    a, b = mixed_length(100, seed=5), mixed_length(100, seed=5)
    assert a == b
    assert a.prompt_lens != mixed_length(100, seed=6).prompt_lens
    assert {r.output_len for r in mixed_length(10, 0, output_len=77)} == {77}


def test_poisson_arrivals():
    base = mixed_length(4000, seed=1)
    w = with_poisson_arrivals(base, rate_per_s=2.0, seed=9)
    t = np.array([r.arrival_s for r in w])
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() == pytest.approx(0.5, rel=0.07)  # exponential: std == mean
    assert w.prompt_lens == base.prompt_lens  # arrivals do not touch the requests
    assert w == with_poisson_arrivals(base, 2.0, seed=9)
    assert w != with_poisson_arrivals(base, 2.0, seed=10)
    assert w.in_arrival_order() == w.requests
    assert with_poisson_arrivals(base, math.inf, seed=9).is_burst


def test_burst_resets_arrivals_and_keeps_lengths():
    w = with_poisson_arrivals(mixed_length(32, seed=0), 1.0, seed=0)
    assert not w.is_burst
    b = as_burst(w)
    assert b.is_burst and b.prompt_lens == w.prompt_lens
    assert b.name == "mixed-n32@burst" and w.name == "mixed-n32@poisson1"


def test_prompt_tokens_distinct_and_deterministic():
    w = fixed_length(64, 512, 8, seed=11)
    prompts = [prompt_tokens(r, vocab_size=32_000, seed=11, low=3) for r in w]
    assert all(len(p) == 512 for p in prompts)
    assert all(3 <= min(p) and max(p) < 32_000 for p in prompts)
    assert len({tuple(p[:4]) for p in prompts}) == 64  # no shared first block
    assert prompts[5] == prompt_tokens(w.requests[5], 32_000, seed=11, low=3)
    assert prompts[5] != prompt_tokens(w.requests[5], 32_000, seed=12, low=3)


def test_validation():
    with pytest.raises(ValueError):
        WorkloadRequest(0, 0, 1, 0.0)
    with pytest.raises(ValueError):
        WorkloadRequest(0, 1, 1, -1.0)
    with pytest.raises(ValueError):
        Workload("bad", (WorkloadRequest(1, 1, 1, 0.0),), seed=0)
    with pytest.raises(ValueError):
        fixed_length(0, 1, 1)
    with pytest.raises(ValueError):
        mixed_length(10, scale=0.0)
    with pytest.raises(ValueError):
        with_poisson_arrivals(fixed_length(2, 1, 1), 0.0, seed=0)
    with pytest.raises(ValueError):
        prompt_tokens(WorkloadRequest(0, 4, 1, 0.0), vocab_size=10, seed=0, low=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fixed_length(1, 1, 1).name = "x"
