"""Filling a rank's layers round by round (``models/layer_rounds.py``): how FP8-stored layers
are loaded, one staging copy at a time, here with local layers in fp32 on gloo.

One 4-rank pool saves two real Megatron checkpoints with Megatron's own
``dist_checkpointing.save`` (``tests/helpers.save_gpt_checkpoint``): ``tiny`` at TP=2, and a
tied-embedding model with a 211-row vocabulary at TP=1. Then, per case, fresh models
(every parameter set to NaN first, so a parameter no load writes shows) are filled:

* from the checkpoint in one load, and round by round (in place, through staging copies,
  and in rounds bounded by bytes): bit-identical parameters, every rank making the same
  number of ``dist_checkpointing.load`` calls although nodes hold different numbers of
  layers;
* from the seed: through one-layer staging copies, equal to ``fill_seeded_`` on the whole
  model.

Cases: TKNP on 4 nodes x TP1 (1, 2, 2, 1 layers: checkpoint saved at TP2), TKNP-dual on 4
nodes (two blocks a node), TKNP on 2 nodes x TP2 of the tied model (211 rows padded to
256: the endpoints read the whole vocabulary), DCP on one node of TP4 (head-structured QKV),
and, in a second pool of one rank, TKNP on 1 node x TP1 (a world of one process reads part
of a stacked-layer tensor too).
"""

from __future__ import annotations

import time
import warnings
import weakref

import pytest
import torch

from tests.helpers import save_gpt_checkpoint
from tknp_megatron.config import get_preset
from tknp_megatron.launch import spawn
from tknp_megatron.models.layer_rounds import LayerRounds
from tknp_megatron.models.model_config import preset_from_model_config

SEED = 7
TIED = dict(name="tiny-tied-odd", num_layers=4, hidden_size=64, num_attention_heads=4,
            num_query_groups=2, kv_channels=16, ffn_hidden_size=160, normalization="RMSNorm",
            gated_linear_unit=True, add_bias_linear=False, activation="silu",
            max_sequence_length=512, vocab_size=211, share_embeddings_and_output_weights=True)
# name: (mode, preset, checkpoint, nodes, tp); WORLD4 runs in a pool of 4 ranks, the rest in one of 1
CASES = {
    "tknp-N4T1": ("tknp", "tiny", "tp2", 4, 1),
    "dual-N4T1": ("tknp-dual", "tiny", "tp2", 4, 1),
    "tied-padded-N2T2": ("tknp", "tied", "tied", 2, 2),
    "dcp-T4": ("dcp", "tiny", "tp2", 1, 4),
    "one-rank-N1T1": ("tknp", "tiny", "tp2", 1, 1),
}
WORLD4 = ("tknp-N4T1", "dual-N4T1", "tied-padded-N2T2", "dcp-T4")


def _preset(name: str):
    return get_preset("tiny") if name == "tiny" else preset_from_model_config(TIED)


def _params(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    """Same names and bit-identical values (NaN, a parameter never written, differs)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _LoadCalls:
    """Counts this process's calls of Megatron's ``dist_checkpointing.load`` (calling it)."""

    def __init__(self):
        from megatron.core import dist_checkpointing

        self.count, self._real = 0, dist_checkpointing.load

        def counted(*args, **kwargs):
            self.count += 1
            return self._real(*args, **kwargs)

        dist_checkpointing.load = counted

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


class _StagingCopies:
    """Watches ``model.decoder.staging_layer``: ``stale`` is the most staging copies of
    earlier rounds still alive when a copy is built (the load's peak allows none)."""

    def __init__(self, model):
        self.stale, built, build = 0, [], model.decoder.staging_layer

        def watched(g):
            self.stale = max(self.stale, sum(ref() is not None for ref in built))
            layer = build(g)
            built.append(weakref.ref(layer))
            return layer

        model.decoder.staging_layer = watched


def _case(name, ckpts, calls):
    """This rank's results for one case (see the module docstring)."""
    import parallel_state as ps
    from tknp_megatron.engine.factory import Mode, build_model, load_weights, placement_for
    from tknp_megatron.models.checkpoint import checkpoint_padded_vocab_size, load_megatron_checkpoint
    from tknp_megatron.models.layer_rounds import fill_in_rounds_, plan_layer_rounds
    from tknp_megatron.models.weights import fill_seeded_

    mode, preset_name, ckpt, nodes, tp = CASES[name]
    mode, preset, path = Mode(mode), _preset(preset_name), ckpts[ckpt]
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=tp, token_parallel_size=nodes)
    placement = placement_for(mode, preset, groups)
    vocab = None if mode is Mode.DCP else checkpoint_padded_vocab_size(path)

    def fresh():
        model = build_model(mode, preset, placement, groups, torch.float32, torch.device("cpu"),
                            padded_vocab=vocab)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return model

    out = {}
    model = fresh()
    calls.take()
    load_megatron_checkpoint(model, path)
    out["single_calls"] = calls.take()
    single = _params(model)
    out["finite"] = all(torch.isfinite(p).all() for p in single.values())
    out["rows"] = None if model.embedding is None else model.embedding.word_embeddings.weight.shape[0]
    layer_bytes = max(sum(p.numel() for p in model.layer(g).parameters()) * 4 for g in model.layer_ids)
    plans = {
        "in_place": lambda m: plan_layer_rounds(m),
        "staged": lambda m: plan_layer_rounds(m, staging=True),
        "two_layers": lambda m: plan_layer_rounds(m, round_bytes=2 * layer_bytes),
    }
    for how, plan_of in plans.items():
        model = fresh()
        plan, copies = plan_of(model), _StagingCopies(model)
        load_megatron_checkpoint(model, path, plan)
        out[how] = dict(calls=calls.take(), rounds=plan.rounds, staging=plan.staging,
                        same=_same(_params(model), single), stale_copies=copies.stale)
    whole, staged = fresh(), fresh()
    fill_seeded_(whole, preset, SEED)
    copies = _StagingCopies(staged)
    load_weights(staged, preset, SEED, plan_layer_rounds(staged, staging=True))
    out["seeded_stale_copies"] = copies.stale
    out["seeded_same"] = _same(_params(whole), _params(staged))
    out["single_is_seeded"] = _same(single, _params(whole))  # the checkpoint holds the seed's values
    out["seeded_finite"] = all(torch.isfinite(p).all() for p in whole.parameters())
    try:  # a plan that does not cover the model's layers is refused
        fill_in_rounds_(staged, lambda part: None, LayerRounds(((),), True))
        out["refused"] = False
    except ValueError:
        out["refused"] = True
    ps.destroy_model_parallel()
    return out


def rounds_worker(rank, world, ckpts, names, save):
    """Save the checkpoints (``save``), then run ``names``: this rank's results by case."""
    warnings.simplefilter("ignore")
    if save:
        save_gpt_checkpoint(get_preset("tiny"), 2, ckpts["tp2"], SEED)
        save_gpt_checkpoint(preset_from_model_config(TIED), 1, ckpts["tied"], SEED, vocab_rows=211)
    calls = _LoadCalls()
    out = {}
    for name in names:
        t0 = time.monotonic()
        out[name] = _case(name, ckpts, calls)
        out[name]["seconds"] = time.monotonic() - t0
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Case -> every rank's results."""
    ckpts = {n: str(tmp_path_factory.mktemp(n)) for n in ("tp2", "tied")}
    t0 = time.monotonic()
    four = spawn(rounds_worker, 4, (ckpts, WORLD4, True), timeout_s=300)
    t1 = time.monotonic()
    rest = [n for n in CASES if n not in WORLD4]
    one = spawn(rounds_worker, 1, (ckpts, rest, False), timeout_s=120)
    print(f"pool seconds {t1 - t0:.1f} {time.monotonic() - t1:.1f}; per case",
          {n: round((four if n in WORLD4 else one)[0][n]["seconds"], 1) for n in CASES})
    return {n: [out[n] for out in (four if n in WORLD4 else one)] for n in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_rounds_load_what_one_load_loads(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["finite"] and r["single_calls"] == 1, (rank, r)
        for how in ("in_place", "staged", "two_layers"):
            assert r[how]["same"] and r[how]["stale_copies"] == 0, (rank, how, r[how])
        assert r["staged"]["staging"] and not r["in_place"]["staging"]
    seeded = [r["single_is_seeded"] for r in runs[case]]
    if CASES[case][2] == "tp2":
        assert all(seeded), seeded
    else:  # rows 211-255 load as zeros, not the seed's values: TP rank 1 of each node holds them
        assert seeded == [True, False, True, False], seeded


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_makes_the_same_number_of_loads(runs, case):
    for how in ("in_place", "staged", "two_layers"):
        calls = {r[how]["calls"] for r in runs[case]}
        rounds = [len(r[how]["rounds"]) for r in runs[case]]
        assert calls == {max(rounds)}, (how, calls, rounds)


def test_nodes_hold_uneven_rounds_and_bytes_group_layers(runs):
    """The pool is a real test of the agreement: ranks' own round counts differ."""
    plans = [r["in_place"]["rounds"] for r in runs["tknp-N4T1"]]
    assert plans == [((0,),), ((1,), (2,)), ((3,), (4,)), ((5,),)]
    grouped = [r["two_layers"]["rounds"] for r in runs["tknp-N4T1"]]
    assert grouped == [((0,),), ((1, 2),), ((3, 4),), ((5,),)]
    assert runs["dual-N4T1"][0]["in_place"]["rounds"] == ((0,), (3,), (4,))
    assert runs["one-rank-N1T1"][0]["in_place"]["rounds"] == tuple((g,) for g in range(6))


def test_padded_vocabulary_endpoints(runs):
    rows = {r["rows"] for r in runs["tied-padded-N2T2"]} - {None}
    assert rows == {128}  # 211 checkpoint rows, served at TP2 as 256: 128 a rank


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_fill_through_staging_equals_whole_fill(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["seeded_finite"] and r["seeded_same"], rank
        assert r["seeded_stale_copies"] == 0, rank  # each round's copy freed before the next's
        assert r["refused"], rank


def test_layer_rounds_contract():
    with pytest.raises(ValueError, match="empty"):
        LayerRounds((), False)
    with pytest.raises(ValueError, match="more than one round"):
        LayerRounds(((0, 1), (1,)), True)
    assert LayerRounds(((3,), (1, 2)), True).layers == (1, 2, 3)
