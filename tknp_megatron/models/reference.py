"""The non-TKNP reference: Megatron's own ``GPTModel`` on one rank, no KV cache.

Every generated token is computed by running Megatron's ``TransformerBlock.forward`` over
the whole sequence (prompt + tokens so far): no paging, no scatter/gather, no block
handoffs, no TP. Its weights come from the same source as the TKNP ranks' (seeded by
checkpoint key, or a checkpoint), so TKNP must reproduce its tokens exactly in fp32.
Only the core attention is swapped for a CPU-capable SDPA (see :mod:`cpu_shims`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from tknp_megatron.config import ModelPreset
from tknp_megatron.executor.rope import Rope
from tknp_megatron.models.cpu_shims import SDPACoreAttention
from tknp_megatron.models.model import final_norm_spec, layer_spec, padded_vocab_size
from tknp_megatron.models.precision import DenseFormat, store_fp8_weights_
from tknp_megatron.sampling import SamplingParams, sample

__all__ = ["ReferenceOutput", "build_reference_model", "reference_generate", "reference_to_fp8"]


@dataclass(frozen=True)
class ReferenceOutput:
    """Generated tokens of one request and their logits ``[n, vocab]``; with
    ``return_prompt_log_probs`` the logits at the prompt's positions but its last
    ``[len(prompt) - 1, vocab]`` (each predicting the next prompt token)."""

    tokens: tuple
    logits: torch.Tensor
    prompt_logits: Optional[torch.Tensor] = None


def build_reference_model(
    preset: ModelPreset,
    params_dtype: torch.dtype = torch.float32,
    device=torch.device("cpu"),
    vocab_size: Optional[int] = None,
    tp: int = 1,
    dense: DenseFormat = DenseFormat(transformer_impl="local"),
) -> GPTModel:
    """A full Megatron ``GPTModel`` (uninitialised; fill or load it, then with FP8 call
    :func:`reference_to_fp8`), TP=1 unless ``tp`` says otherwise (tests save checkpoints at
    other TP sizes with it).

    ``vocab_size`` overrides the padded vocabulary (a checkpoint's embedding rows).
    ``dense`` picks Megatron's local spec (core attention: the CPU-capable SDPA shim) or
    its TE spec with TE's own core attention, and the FP8 config.
    Needs ``megatron.core.parallel_state`` initialised with TP = ``tp``, PP = 1.
    """
    dense = dense.resolved(torch.device(device))
    config = preset.to_transformer_config(tp, params_dtype, use_cpu_initialization=not dense.use_te,
                                          **dense.config_overrides())
    spec = layer_spec(preset, dense.use_te)
    if not dense.use_te:
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    block = TransformerBlockSubmodules(
        layer_specs=[spec] * preset.num_layers, layer_norm=final_norm_spec(preset, dense.use_te)
    )
    model = GPTModel(
        config,
        block,
        vocab_size=vocab_size or padded_vocab_size(preset, tp),
        max_sequence_length=preset.gpt.max_sequence_length,
        position_embedding_type=preset.gpt.position_embedding_type,
        rotary_percent=preset.gpt.rotary_percent,
        rotary_base=preset.gpt.rotary_base,
        rope_scaling=preset.gpt.rope_scaling,
        rope_scaling_factor=preset.gpt.rope_scaling_factor,
        share_embeddings_and_output_weights=preset.gpt.share_embeddings_and_output_weights,
    )
    return model.to(device).eval()


def reference_to_fp8(model: GPTModel, preset: ModelPreset) -> GPTModel:
    """A loaded TE-spec reference with FP8-stored GEMM weights (:func:`~tknp_megatron.models.precision.store_fp8_weights_`:
    each layer rebuilt FP8 and loaded from the loaded one), quantized exactly as a TKNP
    rank's, whose FP8 layers load from staging copies in the run's dtype
    (:func:`~tknp_megatron.models.precision.load_layer_from_` both); its decoder then runs
    them under Megatron's own FP8 context."""
    decoder, spec = model.decoder, layer_spec(preset, use_te=True)

    def build_layer(i: int):
        return build_module(spec, config=model.config, layer_number=i + 1,
                            pg_collection=decoder.pg_collection)

    store_fp8_weights_(model, decoder.layers, build_layer)
    return model


@torch.no_grad()
def reference_logits(model: GPTModel, rope: Rope, tokens: torch.Tensor, vocab: int):
    """``[S]`` token ids -> ``[S, vocab]`` float32 logits via Megatron's decoder."""
    ids = tokens.unsqueeze(0)  # [b=1, s]
    hidden = model.embedding(ids, position_ids=None)  # [s, b, h]
    freqs = rope.freqs(torch.arange(tokens.numel(), device=tokens.device))
    hidden = model.decoder(hidden, attention_mask=None, rotary_pos_emb=freqs)
    tied = model.share_embeddings_and_output_weights  # then the output layer owns no weight
    weight = model.shared_embedding_or_output_weight() if tied else None
    logits, _ = model.output_layer(hidden, weight=weight)
    return logits[:, 0, :vocab].float()


def reference_generate(
    model: GPTModel,
    preset: ModelPreset,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    request_ids: Optional[Sequence[int]] = None,
) -> List[ReferenceOutput]:
    """Generate for each prompt independently, recomputing the full sequence per token.

    Sampling uses the same seeded sampler as TKNP with the same (seed, request id, step),
    so non-greedy sampling is comparable too.
    """
    device = next(model.parameters()).device
    rope = Rope(preset, model.config, device)
    ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
    out = []
    for rid, prompt, p in zip(ids, prompts, params):
        tokens = list(prompt)
        logits_rows, prompt_logits = [], None
        for step in range(p.max_new_tokens):
            every = reference_logits(model, rope, torch.tensor(tokens, device=device), preset.vocab_size)
            if step == 0 and p.return_prompt_log_probs:
                prompt_logits = every[:-1].cpu()
            logits = every[-1:]
            logits_rows.append(logits[0])
            tok = sample(
                logits,
                torch.tensor([p.temperature], device=device),
                torch.tensor([p.top_k], device=device),
                torch.tensor([p.top_p], device=device),
                torch.tensor([p.seed], device=device),
                torch.tensor([rid if p.noise_id is None else p.noise_id], device=device),
                torch.tensor([step], device=device),
            )
            tokens.append(int(tok[0]))
            if p.eos_id is not None and tokens[-1] == p.eos_id:
                break
            generated = tuple(tokens[len(prompt):])
            if any(generated[-len(seq):] == tuple(seq) for seq in p.stop_sequences if len(generated) >= len(seq)):
                break  # ends with a stop sequence (kept)
        out.append(ReferenceOutput(tuple(tokens[len(prompt):]), torch.stack(logits_rows).cpu(), prompt_logits))
    return out
