"""Tests of tknp_megatron.sampling: validation, greedy, determinism, distributions."""

import math

import pytest
import torch

from tknp_megatron.sampling import (
    GREEDY_BELOW,
    SamplingParams,
    greedy,
    hash_uniform,
    sample,
    sampling_tensors,
)


def _draw(logits, params, request_ids, steps):
    return sample(logits, *sampling_tensors(params, request_ids, steps, logits.device))


def _repeat_draws(logits_row, params, n, request_id=7):
    """n draws for one request at steps 0..n-1: ``[n]`` int64."""
    logits = logits_row[None, :].expand(n, -1)
    return _draw(logits, [params] * n, [request_id] * n, list(range(n)))


# --- SamplingParams -----------------------------------------------------------------


def test_params_defaults_are_greedy_and_valid():
    p = SamplingParams()
    assert p.is_greedy and p.problems() == []


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.1), dict(temperature=math.inf), dict(top_p=0.0), dict(top_p=1.5),
     dict(top_k=-1), dict(eos_id=-2), dict(seed=2**63)],
)
def test_params_reject_bad_fields(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_params_max_new_tokens_is_reported_not_raised():
    p = SamplingParams(max_new_tokens=0)
    assert len(p.problems()) == 1 and "max_new_tokens" in p.problems()[0]


def test_sampling_tensors_shapes_and_dtypes():
    params = [SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=11), SamplingParams()]
    t = sampling_tensors(params, [4, 5], [0, 2], "cpu")
    assert [x.shape for x in t] == [torch.Size([2])] * 6
    assert t.temperature.dtype == t.top_p.dtype == torch.float32
    assert t.top_k.dtype == t.seeds.dtype == t.request_ids.dtype == t.steps.dtype == torch.int64
    assert t.seeds.tolist() == [11, 0] and t.steps.tolist() == [0, 2]
    with pytest.raises(ValueError, match="lengths differ"):
        sampling_tensors(params, [4], [0, 2])


def test_temperatures_below_greedy_below_are_greedy():
    """Logits divided by a temperature near float32's smallest normal overflow to infinity,
    and an argmax over them takes the first infinite one: such temperatures are greedy."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 5
    for t in (1e-45, 1e-40, 1e-30, 0.5 * GREEDY_BELOW):
        p = SamplingParams(temperature=t, seed=3)
        assert p.temperature == 0.0 and p.is_greedy
        assert torch.equal(_draw(logits, [p] * 4, range(4), [0] * 4), logits.argmax(-1))
        hot = sampling_tensors([SamplingParams(temperature=1.0)] * 4, range(4), [0] * 4)
        raw = sample(logits, hot.temperature * t, *hot[1:])  # the draw itself, given such a temperature
        assert torch.equal(raw, logits.argmax(-1)), t
    assert not SamplingParams(temperature=GREEDY_BELOW).is_greedy


def test_a_noise_id_stands_for_the_request_id():
    """``noise_id`` keys the noise in place of the request's id: rows of other requests with
    one seed and noise id draw alike; the planned columns carry it (else the request id)."""
    from tknp_megatron.plan import RequestColumns

    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(2)).expand(4, -1)
    seeded = SamplingParams(temperature=1.0, seed=9, noise_id=3)
    same = _draw(logits, [seeded] * 4, [3, 3, 3, 3], [5] * 4)
    cols = RequestColumns.of(request_ids=[10, 11, 12, 13], noise_ids=[3, 3, 3, 3], slots=[0] * 4, q_lens=[1] * 4,
                             start_pos=[0] * 4, temperature=[1.0] * 4, top_k=[0] * 4, top_p=[1.0] * 4,
                             seeds=[9] * 4, sample_steps=[5] * 4)
    assert torch.equal(sample(logits, *cols.sampling()), same) and len(set(same.tolist())) == 1
    assert len(set(_draw(logits, [seeded] * 4, [10, 11, 12, 13], [5] * 4).tolist())) > 1
    with pytest.raises(ValueError, match="noise_id"):
        SamplingParams(noise_id=2**63)


# --- greedy and hashing ---------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    expect = logits.argmax(-1)
    assert torch.equal(greedy(logits), expect)
    params = [SamplingParams(top_k=2, top_p=0.3, seed=i) for i in range(6)]
    assert torch.equal(_draw(logits, params, range(6), [3] * 6), expect)


def test_hash_uniform_range_and_key_sensitivity():
    ids = torch.tensor([0, 1, 0, 0])
    u = hash_uniform(torch.tensor([0, 0, 1, 0]), ids, torch.tensor([0, 0, 0, 1]), 4096)
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 0.01
    corr = torch.corrcoef(u) - torch.eye(4)
    assert corr.abs().max().item() < 0.08  # changing any key decorrelates the row
    extreme = hash_uniform(torch.tensor([-(2**63)]), torch.tensor([-1]), torch.tensor([2**40]), 8)
    assert bool(((extreme > 0) & (extreme < 1)).all())


# --- determinism ----------------------------------------------------------------------


def _mixed_batch(n=8, vocab=64):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(n, vocab, generator=g) * 2
    params = [
        SamplingParams(temperature=0.5 + 0.25 * i, top_k=(0, 5, 20)[i % 3],
                       top_p=(1.0, 0.9, 0.5)[i % 3], seed=100 + i)
        for i in range(n)
    ]
    return logits, params, list(range(30, 30 + n)), [i * 3 for i in range(n)]


def test_same_tokens_under_row_permutation():
    logits, params, rids, steps = _mixed_batch()
    base = _draw(logits, params, rids, steps)
    for seed in range(3):
        perm = torch.randperm(len(params), generator=torch.Generator().manual_seed(seed))
        p = perm.tolist()
        out = _draw(logits[perm], [params[i] for i in p], [rids[i] for i in p],
                    [steps[i] for i in p])
        assert torch.equal(out, base[perm])


def test_same_tokens_whatever_the_batch_composition():
    logits, params, rids, steps = _mixed_batch()
    base = _draw(logits, params, rids, steps)
    for i in range(len(params)):  # each row alone
        alone = _draw(logits[i : i + 1], [params[i]], [rids[i]], [steps[i]])
        assert alone.item() == base[i].item()
    other = torch.randn(3, logits.shape[1])  # mixed with unrelated rows
    big = torch.cat([other, logits[2:5]])
    extra = [SamplingParams(temperature=1.0, seed=9)] * 3
    out = _draw(big, extra + params[2:5], [1, 2, 3] + rids[2:5], [0, 0, 0] + steps[2:5])
    assert torch.equal(out[3:], base[2:5])


def test_draw_depends_on_seed_request_and_step():
    row = torch.zeros(1000)  # uniform: tokens are just the hash's argmax
    p = SamplingParams(temperature=1.0, seed=3)
    base = _draw(row[None], [p], [5], [2]).item()
    changed = [
        _draw(row[None], [SamplingParams(temperature=1.0, seed=4)], [5], [2]).item(),
        _draw(row[None], [p], [6], [2]).item(),
        _draw(row[None], [p], [5], [3]).item(),
    ]
    assert all(c != base for c in changed)


# --- distributions --------------------------------------------------------------------


def _chi_square(counts, probs):
    n = counts.sum()
    expected = probs * n
    return (((counts - expected) ** 2) / expected).sum().item()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    n = 40_000
    tokens = _repeat_draws(logits, SamplingParams(temperature=temperature, seed=1), n)
    counts = torch.bincount(tokens, minlength=8).double()
    probs = torch.softmax(logits.double() / temperature, -1)
    # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4
    assert _chi_square(counts, probs) < 30.0


def test_top_k_stays_within_k_largest():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, generator=g)
    for k in (1, 3, 10):
        allowed = set(torch.topk(logits, k).indices.tolist())
        tokens = _repeat_draws(logits, SamplingParams(temperature=5.0, top_k=k), 3000)
        picked = set(tokens.tolist())
        assert picked <= allowed
        assert len(picked) == k  # high temperature: every allowed token shows up


def test_top_p_stays_within_nucleus():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.02, 0.3, 0.13, 0.1]))
    # sorted: 0.4, 0.3, 0.13, 0.1, ...; mass before = 0, .4, .7, .83 -> top_p=0.75 keeps 3
    tokens = _repeat_draws(logits, SamplingParams(temperature=1.0, top_p=0.75), 5000)
    assert set(tokens.tolist()) == {1, 3, 4}
    counts = torch.bincount(tokens, minlength=6).double()[[1, 3, 4]]
    probs = torch.tensor([0.4, 0.3, 0.13], dtype=torch.float64) / 0.83
    assert _chi_square(counts, probs) < 20.0
    tiny = _repeat_draws(logits, SamplingParams(temperature=1.0, top_p=0.01), 200)
    assert set(tiny.tolist()) == {1}  # the top token always survives


def test_top_k_and_top_p_combine():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    # top_k=3 renormalises to .444, .333, .222; top_p=0.5 then keeps 2
    tokens = _repeat_draws(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.5), 2000)
    assert set(tokens.tolist()) == {0, 1}


def test_large_temperature_approaches_uniform():
    logits = torch.tensor([5.0, 2.0, 0.0, -2.0, -5.0])
    tokens = _repeat_draws(logits, SamplingParams(temperature=1e4, seed=5), 20_000)
    counts = torch.bincount(tokens, minlength=5).double()
    assert _chi_square(counts, torch.full((5,), 0.2, dtype=torch.float64)) < 25.0


def test_masked_logits_are_never_drawn():
    logits = torch.tensor([0.0, -math.inf, 0.0, -math.inf])
    tokens = _repeat_draws(logits, SamplingParams(temperature=1.0), 500)
    assert set(tokens.tolist()) == {0, 2}


# --- dtypes and graph-friendliness ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_logits(dtype):
    logits, params, rids, steps = _mixed_batch()
    low = logits.to(dtype)
    out = _draw(low, params, rids, steps)
    assert out.dtype == torch.int64 and out.shape == (len(params),)
    assert torch.equal(out, _draw(low.float(), params, rids, steps))
    assert torch.equal(greedy(low), low.float().argmax(-1))


def test_runs_on_meta_tensors():
    # Meta tensors hold no data: .item(), host syncs and data-dependent shapes (boolean
    # indexing, nonzero) all raise on them, so this checks the CUDA-graph requirements.
    logits, params, rids, steps = _mixed_batch()
    tensors = sampling_tensors(params, rids, steps, "meta")
    out = sample(logits.to("meta", torch.bfloat16), *tensors)
    assert out.device.type == "meta" and out.shape == (len(params),) and out.dtype == torch.int64


def test_compiles_as_one_graph():
    logits, params, rids, steps = _mixed_batch()
    tensors = sampling_tensors(params, rids, steps)
    compiled = torch.compile(sample, backend="eager", fullgraph=True)
    logits2 = torch.randn_like(logits)
    assert torch.equal(compiled(logits2, *tensors), sample(logits2, *tensors))


def test_top_k_above_vocab_is_off():
    logits, params, rids, steps = _mixed_batch(vocab=16)
    big = [SamplingParams(temperature=1.0, top_k=1000, seed=i) for i in range(len(params))]
    off = [SamplingParams(temperature=1.0, top_k=0, seed=i) for i in range(len(params))]
    assert torch.equal(_draw(logits, big, rids, steps), _draw(logits, off, rids, steps))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    logits, params, rids, steps = _mixed_batch(n=32, vocab=4096)
    cpu = _draw(logits, params, rids, steps)
    gpu = _draw(logits.cuda(), params, rids, steps)
    assert torch.equal(gpu.cpu(), cpu)
    t = sampling_tensors(params, rids, steps)
    tc = sampling_tensors(params, rids, steps, "cuda")
    u = hash_uniform(t.seeds, t.request_ids, t.steps, 4096)
    assert torch.equal(hash_uniform(tc.seeds, tc.request_ids, tc.steps, 4096).cpu(), u)
