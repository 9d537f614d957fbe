"""The prompt rows' log-probs, made a slice of rows at a time: the same numbers whatever the
slice, TP 2's gathered logits the same as TP 1's (fp32, gloo on CPU)."""

from __future__ import annotations

import warnings

import torch

from tknp_megatron.launch import spawn


def slices_worker(rank, world, rows: int, slices):
    """Packed log-probs of ``rows`` random hidden rows, 11 of them named (shuffled, with
    targets), at each slice size in ``slices``, on a tiny model at TP ``world``."""
    warnings.simplefilter("ignore")
    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.executor import prompt_log_probs as module
    from tknp_megatron.models.reference import build_reference_model
    from tknp_megatron.models.weights import fill_seeded_

    groups = ps.initialize_model_parallel(tensor_model_parallel_size=world, token_parallel_size=1)
    preset = get_preset("tiny")
    model = build_reference_model(preset, tp=world)
    fill_seeded_(model, preset, 3)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, 1, preset.hidden_size, generator=gen)
    prompt = module.PromptRows(torch.randperm(rows, generator=gen)[:11], torch.randint(0, 512, (11,), generator=gen))
    out = []
    for size in slices:
        module.ROWS_PER_SLICE = size
        out.append(module.prompt_log_probs(model, hidden, prompt, 3, groups.tp_group, world, preset.vocab_size))
    ps.destroy_model_parallel()
    return out, prompt


def test_slices_and_tp_give_the_same_log_probs():
    whole, prompt = spawn(slices_worker, 1, (16, (1024, 4, 1)), timeout_s=120)[0]
    tp2, _ = spawn(slices_worker, 2, (16, (5,)), timeout_s=120)[0]
    assert whole[0].shape == (11, 1 + 2 * 3)
    for other in whole[1:] + tp2:
        torch.testing.assert_close(other, whole[0], atol=1e-5, rtol=0)
    assert (whole[0][:, 0] <= 0).all() and (whole[0][:, 1] >= whole[0][:, 0]).all()  # the top one is the most likely
