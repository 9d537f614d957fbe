"""Megatron distributed checkpoints: TP=2 GPTModel saved with dist_checkpointing, served by TKNP.

A plain Megatron-Core ``GPTModel`` at TP=2 is filled from the seeded source and saved in
``torch_dist`` format. TKNP pools (N, T) = (2, 1) and (2, 2) load it into StageModels
(built uninitialised, so any weight the load missed shows up as garbage) and decode; the
TP=1 reference GPTModel loads the same checkpoint. Greedy tokens equal, logits within 1e-4.

Memory: a bigger model (hidden 512, 8 layers, vocab 16000, ~190 MB fp32) is saved at TP=4,
then a *fresh* N=4, T=1 pool loads it; each rank samples its process RSS every ~1 ms from
a thread during ``load_megatron_checkpoint``. Parameters are allocated uninitialised
before the baseline (untouched pages are not resident), so the RSS growth counts the
pages the load writes plus any staging copies: it must stay near the rank's own
parameter bytes and well below the full model's.
"""

from __future__ import annotations

import json
import threading
import time
import warnings

import pytest
import torch

from tests.helpers import assert_matches_reference, save_gpt_checkpoint
from tests.tknp_workers import Scenario, run_scenario
from tknp_megatron.config import get_preset
from tknp_megatron.launch import spawn
from tknp_megatron.models.model_config import preset_from_model_config

SEED = 11
SCENARIO = Scenario(
    "ckpt", "tiny",
    prompts=((5, 17, 300, 2), (9, 9, 1, 44, 200, 3, 7, 100, 8), (400,)),
    max_new=(6, 4, 5), kv_tokens_per_node=128,
)
BIG = dict(num_layers=8, hidden_size=512, num_attention_heads=8, num_query_groups=4,
           ffn_hidden_size=2048, normalization="RMSNorm", gated_linear_unit=True,
           add_bias_linear=False, activation="silu", vocab_size=16000,
           max_sequence_length=256, name="big-ckpt")


def _serve(n: int, t: int, ckpt_dir: str):
    import parallel_state as ps
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine

    preset = get_preset(SCENARIO.preset)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=t, token_parallel_size=n)
    config = EngineConfig(block_size=4, kv_tokens_per_node=SCENARIO.kv_tokens_per_node,
                          record_logits=True, attention_backend="torch")
    engine = build_engine(Mode.TKNP, preset, groups, config, torch.device("cpu"), torch.float32,
                          weights=ckpt_dir)
    out = run_scenario(engine, SCENARIO, None)
    ps.destroy_model_parallel()
    return out


def world2_worker(rank, world, ckpt_dir):
    """Save at TP=2; serve with (N, T) = (2, 1); the TP=1 reference loads the checkpoint."""
    warnings.simplefilter("ignore")
    import parallel_state as ps
    from tests.tknp_workers import params_for
    from tknp_megatron.models.checkpoint import load_megatron_checkpoint
    from tknp_megatron.models.reference import build_reference_model, reference_generate

    preset = get_preset(SCENARIO.preset)
    save_gpt_checkpoint(preset, 2, ckpt_dir, SEED)
    tknp = _serve(2, 1, ckpt_dir)
    ps.initialize_model_parallel(1)
    ref_model = build_reference_model(preset)
    load_megatron_checkpoint(ref_model, ckpt_dir)  # collective: every rank loads
    ref = reference_generate(ref_model, preset, SCENARIO.prompts, params_for(SCENARIO))
    ps.destroy_model_parallel()
    return (tknp, ref) if rank == 0 else None


def world4_worker(rank, world, ckpt_dir, big_dir):
    """Serve the tiny checkpoint with (2, 2); save the big model at TP=4."""
    warnings.simplefilter("ignore")
    tknp = _serve(2, 2, ckpt_dir)
    save_gpt_checkpoint(preset_from_model_config(BIG), 4, big_dir, seed=None)  # values do not matter
    return tknp if rank == 0 else None


def _anonymous_rss() -> int:
    """This process's resident anonymous memory (tensors, the heap), without the shared
    libraries' pages: a pool worker forked from a preloaded server faults those in as it
    first runs a code path, which is not memory the load allocates."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    import psutil

    return psutil.Process().memory_info().rss


def memory_worker(rank, world, big_dir):
    """Fresh N=4 pool: resident memory growth while loading vs the rank's own parameter bytes."""
    warnings.simplefilter("ignore")

    import parallel_state as ps
    from tknp_megatron.engine.factory import (
        Mode,
        build_model,
        load_weights,
        placement_for,
    )
    from tknp_megatron.models.checkpoint import checkpoint_padded_vocab_size

    preset = preset_from_model_config(BIG)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=world)
    placement = placement_for(Mode.TKNP, preset, groups)
    vocab = checkpoint_padded_vocab_size(big_dir)  # saved at TP=4: padded to 16384, not 16000
    model = build_model(Mode.TKNP, preset, placement, groups, torch.float32, torch.device("cpu"),
                        padded_vocab=vocab)
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    base = peak = _anonymous_rss()
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _anonymous_rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    load_weights(model, preset, big_dir)
    done.set()
    sampler.join()
    peak = max(peak, _anonymous_rss())
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    ps.destroy_model_parallel()
    return dict(own=own, growth=peak - base, finite=finite, vocab=vocab)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tiny = str(tmp_path_factory.mktemp("tiny_tp2"))
    big = str(tmp_path_factory.mktemp("big_tp4"))
    t0 = time.monotonic()
    tknp21, ref = spawn(world2_worker, 2, (tiny,), timeout_s=180)[0]
    t1 = time.monotonic()
    tknp22 = spawn(world4_worker, 4, (tiny, big), timeout_s=180)[0]
    t2 = time.monotonic()
    memory = spawn(memory_worker, 4, (big,), timeout_s=180)
    print(f"pool seconds: {t1 - t0:.1f} {t2 - t1:.1f} {time.monotonic() - t2:.1f}; memory {memory}")
    return {(2, 1): tknp21, (2, 2): tknp22, "ref": ref, "memory": memory}


@pytest.mark.parametrize("shape", [(2, 1), (2, 2)], ids=lambda s: f"N{s[0]}T{s[1]}")
def test_tknp_from_tp2_checkpoint_matches_reference(runs, shape):
    assert_matches_reference(runs[shape]["results"], runs["ref"])


def test_load_memory_is_per_block(runs):
    full = preset_from_model_config(BIG).total_params() * 4
    for rank, m in enumerate(runs["memory"]):
        assert m["finite"] and m["vocab"] == 16384
        assert m["own"] < 0.4 * full  # the rank stores about a quarter
        # one copy of its own parameters plus small staging; never the full model
        assert m["growth"] < 1.5 * m["own"] + 16 * 2**20, (rank, m, full)
        assert m["growth"] < 0.6 * full, (rank, m, full)


def test_model_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"\['hiden_size'\]"):
        preset_from_model_config({**BIG, "hiden_size": 3})
    with pytest.raises(ValueError, match="max_sequence_length"):
        preset_from_model_config({k: v for k, v in BIG.items() if k != "max_sequence_length"})


def test_model_config_file(tmp_path):
    from tknp_megatron.models.model_config import load_model_config

    path = tmp_path / "model.json"
    path.write_text(json.dumps({**BIG, "params_dtype": "bfloat16"}))
    preset, dtype = load_model_config(path)
    assert dtype == torch.bfloat16
    assert preset.kv_channels == 64 and preset.num_query_groups == 4 and preset.gated
    assert preset.to_transformer_config().ffn_hidden_size == 2048
