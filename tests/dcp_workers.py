"""Pool workers for the DCP baseline tests (module level so spawn can pickle them)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from tests.tknp_workers import CAPTURED_AHEAD, Scenario, params_for, run_scenario


@dataclass(frozen=True)
class DCPCase:
    """A model variant (``base`` preset with ``kv_heads`` query groups) on ``world`` ranks,
    run on the scenarios named in ``scenarios``."""

    world: int
    base: str
    kv_heads: int
    scenarios: Tuple[str, ...] = ("waves",)

    @property
    def name(self) -> str:
        return f"W{self.world}-{self.base}-kv{self.kv_heads}"

    def preset(self):
        from tknp_megatron.config import get_preset

        return get_preset(self.base).replace(num_query_groups=self.kv_heads)


def reference_worker(rank, world, cases: Sequence[DCPCase], scenarios: Sequence[Scenario], seed: int):
    """Megatron GPTModel (TP = 1) per model variant: generations and layer-0 fused QKV weight."""
    warnings.simplefilter("ignore")
    import parallel_state as ps
    from tknp_megatron.models.reference import build_reference_model, reference_generate
    from tknp_megatron.models.weights import fill_seeded_

    ps.initialize_model_parallel(1)
    out = {}
    variants = {}
    for c in cases:
        variants.setdefault((c.base, c.kv_heads), (c, set()))[1].update(c.scenarios)
    for case, names in variants.values():
        preset = case.preset()
        model = build_reference_model(preset)
        fill_seeded_(model, preset, seed)
        qkv = model.decoder.layers[0].self_attention.linear_qkv.weight.detach().clone()
        gens = {
            s.name: reference_generate(model, preset, s.prompts, params_for(s))
            for s in scenarios if s.name in names
        }
        out[(case.base, case.kv_heads)] = (gens, qkv)
    return out


def dcp_worker(rank, world, cases: Sequence[DCPCase], scenarios: Sequence[Scenario], seed: int):
    """Every case of this world size through the DCP engine; also this rank's layer-0 QKV.
    Scenarios with ``graphs`` take the bucketed, padded decode path that CUDA graphs
    replay (eagerly on CPU) and record no logits (graphs replay the tokens-only step)."""
    warnings.simplefilter("ignore")
    import parallel_state as ps
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine

    out = {}
    for case in cases:
        if case.world != world:
            continue
        preset = case.preset()
        groups = ps.initialize_model_parallel(tensor_model_parallel_size=world, token_parallel_size=1)
        for s in scenarios:
            if s.name not in case.scenarios:
                continue
            config = EngineConfig(block_size=s.block_size, kv_tokens_per_node=s.kv_tokens_per_node,
                                  record_logits=not s.graphs, cuda_graphs=s.graphs)
            engine = build_engine(Mode.DCP, preset, groups, config, torch.device("cpu"), torch.float32,
                                  weights=seed)
            if s.row_align > 1:  # what an FP8 Llama's executor takes from TE (row_alignment)
                assert engine.executor.row_align == 1  # fp32 here: nothing padded by the step
                engine.executor.row_align = s.row_align
            if s.graphs:  # the all-padding steps a GPU captures at start-up, run first (eagerly
                # here): their k/v writes go to the scratch block, so no request's tokens change
                assert engine.executor.graphs.capture_buckets(CAPTURED_AHEAD) > 0
            qkv = engine.executor.model.layer(0).self_attention.linear_qkv.weight.detach().clone()
            out[(case.name, "qkv")] = qkv
            # a layer rebuilt from the model's spec (what FP8 storage does) is DCP's again
            rebuilt = engine.executor.model.decoder.build_layer(0).self_attention.linear_qkv
            out[(case.name, "rebuilt")] = (type(rebuilt).__name__, tuple(rebuilt.weight.shape))
            out[(case.name, "dcp")] = (engine.dcp.degree, engine.dcp.shard, engine.dcp.kv_head)
            out[(case.name, s.name, "triton")] = engine.executor.fused_decode
            out[(case.name, s.name)] = run_scenario(engine, s, None)
            out[(case.name, s.name, "kv")] = _cache_summary(engine)
        ps.destroy_model_parallel()
    return out


def _cache_summary(engine) -> Tuple[int, int]:
    """(tokens per local block, local blocks) of this rank's shard cache."""
    spec = engine.kv.spec
    return spec.block_size, spec.num_blocks


def fa3_refusal_worker(rank, world, case: DCPCase) -> str:
    """Build ``case``'s DCP engine on CPU with ``attention_backend="fa3"``: the one line it
    is refused with (FA3 runs only on Hopper GPUs), or "" if it was built."""
    warnings.simplefilter("ignore")
    import parallel_state as ps
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine

    groups = ps.initialize_model_parallel(tensor_model_parallel_size=world, token_parallel_size=1)
    try:
        build_engine(Mode.DCP, case.preset(), groups, EngineConfig(kv_tokens_per_node=256, attention_backend="fa3"),
                     torch.device("cpu"), torch.float32, weights=0)
        return ""
    except RuntimeError as exc:
        return str(exc)
    finally:
        ps.destroy_model_parallel()
