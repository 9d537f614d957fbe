"""Pool workers for the end-to-end TKNP tests (module level so spawn can pickle them)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from tests.helpers import random_prompts


CAPTURED_AHEAD = 8  # graph buckets (per owner) run ahead of the graph scenarios: 1, 2, 4, 8


@dataclass(frozen=True)
class Scenario:
    """One engine run: prompts, per-request sampling, KV budget, optional external KV."""

    name: str
    preset: str
    prompts: Tuple[Tuple[int, ...], ...]
    max_new: Tuple[int, ...]
    kv_tokens_per_node: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    ingest: bool = False  # use the reference's KV for prompt[:-1]
    block_size: int = 4
    extra_bad: bool = False  # append invalid requests
    graphs: bool = False  # bucketed, padded decode path (what CUDA graphs replay)
    row_align: int = 1  # the roots' rows padded with zero rows to a multiple of it (FP8 runs: 16)
    eos_id: Optional[int] = None
    log_probs: int = -1  # >= 0: return log-probs with this many top tokens
    prompt_log_probs: bool = False  # the prompt's log-probs too (needs log_probs >= 0)
    stop: Tuple[Tuple[int, ...], ...] = ()  # stop sequences


def params_for(s: Scenario):
    from tknp_megatron.sampling import SamplingParams

    return [
        SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, max_new_tokens=m,
                       seed=7, eos_id=s.eos_id, return_log_probs=s.log_probs >= 0,
                       top_n_logprobs=max(s.log_probs, 0), stop_sequences=s.stop,
                       return_prompt_log_probs=s.prompt_log_probs)
        for m in s.max_new
    ]


def reference_worker(rank, world, scenarios: Sequence[Scenario], seed: int):
    """Megatron GPTModel reference for each scenario, plus K/V of prompt[:-1] per request."""
    warnings.simplefilter("ignore")
    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.models.reference import build_reference_model, reference_generate
    from tknp_megatron.models.weights import fill_seeded_

    ps.initialize_model_parallel(1)
    out = {}
    models = {}
    for s in scenarios:
        preset = get_preset(s.preset)
        if s.preset not in models:
            m = build_reference_model(preset)
            fill_seeded_(m, preset, seed)
            models[s.preset] = m
        model = models[s.preset]
        ref = reference_generate(model, preset, s.prompts, params_for(s))
        kv = [prefill_kv(model, preset, p[:-1]) for p in s.prompts] if s.ingest else None
        out[s.name] = (ref, kv)
    return out


def prefill_kv(model, preset, tokens) -> torch.Tensor:
    """``[layers, 2, len(tokens), Hkv, d]`` post-RoPE K/V as a prefill server computes them,
    captured from the inputs of Megatron's core attention in the reference model."""
    from tknp_megatron.executor.rope import Rope
    from tknp_megatron.models.reference import reference_logits

    captured = []
    hooks = [
        layer.self_attention.core_attention.register_forward_pre_hook(
            lambda mod, args, kw: captured.append((args[1], args[2])), with_kwargs=True
        )
        for layer in model.decoder.layers
    ]
    try:
        rope = Rope(preset, model.config, torch.device("cpu"))
        reference_logits(model, rope, torch.tensor(list(tokens)), preset.vocab_size)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([torch.stack([k[:, 0], v[:, 0]]) for k, v in captured])


def tknp_worker(rank, world, shapes, scenarios, seed, kv_by_scenario, mode="tknp"):
    """For each (N, T[, pools]) of this world and each scenario, run ``mode``'s engine.

    With several pools (the data-parallel baseline, mode ``dp``) each pool serves the
    requests ``i % pools == pool`` under their global ids; pool coordinators return their
    results. ``tknp-dual`` runs dual-active-root microbatching on the dual placement.
    """
    warnings.simplefilter("ignore")
    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine

    out = {}
    for shape in shapes:
        n, t, pools = (*shape, 1)[:3]
        groups = ps.initialize_model_parallel(
            tensor_model_parallel_size=t, token_parallel_size=n, num_pools=pools
        )
        shape_mode = Mode.DP if pools > 1 else Mode(mode)
        for s in scenarios:
            config = EngineConfig(block_size=s.block_size, kv_tokens_per_node=s.kv_tokens_per_node,
                                  record_logits=not s.graphs, attention_backend="torch",
                                  cuda_graphs=s.graphs)
            engine = build_engine(shape_mode, get_preset(s.preset), groups, config, torch.device("cpu"),
                                  torch.float32, weights=seed)
            if s.row_align > 1:  # what an FP8 Llama's executor takes from TE (row_alignment)
                assert engine.executor.row_align == 1  # fp32 here: nothing padded by the step
                engine.executor.row_align = s.row_align
            if s.graphs and shape_mode in (Mode.TKNP, Mode.DP, Mode.PP):  # (dual roots capture on first sight)
                # the all-padding steps a GPU captures at start-up, run first (eagerly here):
                # they must leave every request's tokens as they were
                assert engine.executor.graphs.capture_buckets(CAPTURED_AHEAD) > 0
            out[(*shape, s.name)] = run_scenario(engine, s, kv_by_scenario.get(s.name))
        ps.destroy_model_parallel()
    return out


DENSE_GEMMS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # a layer's GEMMs, by module name


def run_scenario(engine, s: Scenario, kvs):
    """Submit the scenario on the coordinator and serve it; return results and metrics, and
    the row counts the coordinator's dense GEMMs saw (``gemm_rows``)."""
    from tknp_megatron.sampling import SamplingParams

    if not engine.groups.is_coordinator:
        engine.serve()
        return None
    ids = []
    pools, pool = engine.groups.num_pools, engine.groups.pool
    for i, (prompt, p) in enumerate(zip(s.prompts, params_for(s))):
        if i % pools != pool:
            continue
        kv = kvs[i] if kvs is not None else None
        ids.append(engine.add_request(list(prompt), p, kv=kv, request_id=i))
    if s.extra_bad:
        vocab = engine.preset.vocab_size
        bad = [([], SamplingParams(max_new_tokens=2)), ([1, vocab + 5], SamplingParams(max_new_tokens=2)),
               ([1, 2], SamplingParams(max_new_tokens=0)),
               ([1] * 8, SamplingParams(max_new_tokens=s.kv_tokens_per_node * 4))]
        base = len(s.prompts)
        ids += [engine.add_request(p, sp, request_id=base + j) for j, (p, sp) in enumerate(bad)]
    gemm_rows = set()  # the row counts this rank's dense GEMMs saw
    hooks = [module.register_forward_pre_hook(lambda mod, args: gemm_rows.add(args[0].shape[0]))
             for name, module in engine.executor.model.named_modules() if name.endswith(DENSE_GEMMS)]
    try:
        engine.run_until_done()
    finally:
        for h in hooks:
            h.remove()
    return dict(
        gemm_rows=sorted(gemm_rows),
        results=[engine.result(i) for i in ids],
        waves=engine.metrics().waves,
        capacity=engine.kv_capacity_tokens,
        microbatch={i: engine.requests[i].microbatch for i in ids},
        graph_steps=engine.executor.graphs.replays if getattr(engine.executor, "graphs", None) else 0,
    )


# ---- the scenarios every end-to-end test file runs (see tests/conftest.py) ----

SEED = 3


def _scenarios():
    mixed = random_prompts(10, 2, 30, 1)
    max_new = (6, 3, 8, 1, 5, 7, 2, 6, 4, 8)  # requests finish at different steps
    few = random_prompts(3, 3, 9, 2)
    return [
        # tight budget (40 tokens a node, 192 reserved in all): several waves even on 4 nodes
        Scenario("llama-waves", "tiny", mixed, max_new, kv_tokens_per_node=40),
        Scenario("nemotron-waves", "tiny-nemotron", mixed, max_new, kv_tokens_per_node=40),
        Scenario("qk-norm-waves", "tiny-qk", mixed, max_new, kv_tokens_per_node=40),
        # 3 requests, roomy cache: with 4 nodes one node owns nothing
        Scenario("llama-few", "tiny", few, (5, 5, 5), kv_tokens_per_node=400),
        Scenario("llama-ingest", "tiny", mixed[:6], max_new[:6], kv_tokens_per_node=96, ingest=True),
        # log-probs of the drawn tokens and the top 3, computed on the last root
        Scenario("llama-sampled", "tiny", mixed[:6], max_new[:6], kv_tokens_per_node=96,
                 temperature=0.8, top_k=40, top_p=0.9, log_probs=3),
        # the prompts' log-probs too, from their prefill (a one-token prompt has none)
        Scenario("llama-prompt-log-probs", "tiny", mixed[:5] + ((42,),), max_new[:6], kv_tokens_per_node=96,
                 log_probs=2, prompt_log_probs=True),
        Scenario("llama-graph-path", "tiny", mixed, max_new, kv_tokens_per_node=40, graphs=True),
        # the same with the roots' hidden state padded to 16 rows, as FP8 runs pad it
        Scenario("llama-graph-aligned", "tiny", mixed, max_new, kv_tokens_per_node=40, graphs=True,
                 row_align=16),
        # token 76 is EOS: two requests end on it mid-decode (the reference's greedy tokens
        # of this scenario contain it at steps 2 and 5), while their next step is queued;
        # two more end on a stop sequence (220 373 at steps 3-4, 483 at step 3)
        Scenario("llama-eos", "tiny", mixed, max_new, kv_tokens_per_node=40, eos_id=76,
                 stop=((220, 373), (483,))),
        Scenario("llama-bad-input", "tiny", few, (4, 4, 4), kv_tokens_per_node=64, extra_bad=True),
    ]


SCENARIOS = _scenarios()
