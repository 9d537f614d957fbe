"""Build any mode's engine on this rank: placement, model, weights, config, engine.

Every rank of the pool calls :func:`build_engine` with the same arguments and its own
process groups (``parallel_state.initialize_model_parallel``; :meth:`Mode.pool_shape`
gives a mode's pools, nodes and TP degree for a world). The pieces are public for tools
that need only part of the assembly (a model to load, a hand-sized KV cache)::

    groups = ps.initialize_model_parallel(tensor_model_parallel_size=2, token_parallel_size=2)
    engine = build_engine(Mode.TKNP, preset, groups, EngineConfig(kv_tokens_per_node=4096),
                          device, torch.float32, weights=0)  # or a checkpoint directory
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Optional, Union

import torch

from parallel_state import TokenParallelGroups
from tknp_megatron.config import ModelPreset
from tknp_megatron.engine.base import InferenceEngine
from tknp_megatron.engine.config import EngineConfig
from tknp_megatron.engine.engine import TKNPInferenceEngine
from tknp_megatron.mode import Mode
from tknp_megatron.models.layer_rounds import LayerRounds, fill_in_rounds_, plan_layer_rounds
from tknp_megatron.models.model import StageModel, build_rank_model
from tknp_megatron.models.precision import DenseFormat
from tknp_megatron.models.weights import fill_seeded_
from tknp_megatron.placement import Placement, balanced_placement

__all__ = [
    "Mode", "Weights", "build_engine", "build_model", "dense_format_for", "engine_config_for",
    "load_weights", "placement_for",
]

Weights = Union[int, str, os.PathLike, Callable[[torch.nn.Module], None]]
"""Where weights come from: an int seeds them (:func:`~tknp_megatron.models.weights.fill_seeded_`),
a path is a ``torch_dist`` checkpoint directory (loaded collectively, each rank reading only
its own blocks), a callable fills the model itself, as built: with an FP8 format it then
writes into FP8 parameters (``param.copy_(t)`` or ``load_state_dict`` quantizes ``t`` with
the recipe). Seeds and checkpoints fill FP8-stored layers through one-layer staging copies
in the run's dtype (:mod:`~tknp_megatron.models.layer_rounds`)."""

_ONE_NODE = (Mode.DP, Mode.TP, Mode.DCP)  # pools of a single node


def placement_for(mode: Mode, preset: ModelPreset, groups: TokenParallelGroups,
                  dense: DenseFormat = DenseFormat()) -> Placement:
    """Layer blocks over the pool's nodes (two copies for ``tknp-dual``), balanced by the
    bytes each node stores (FP8 GEMM weights count one byte per element)."""
    return balanced_placement(preset, groups.num_nodes, linear_bytes=dense.linear_bytes or 2,
                              dual=Mode(mode) is Mode.TKNP_DUAL)


def dense_format_for(mode: Mode, dense: DenseFormat, device: torch.device) -> DenseFormat:
    """``dense`` made concrete for ``mode`` on ``device`` (ValueError, one line, if it cannot be).

    Every mode takes every format: DCP's head-structured QKV has a local
    (:class:`~tknp_megatron.baselines.dcp_qkv.DCPQKVLinear`) and a Transformer Engine
    (:class:`~tknp_megatron.baselines.dcp_qkv_te.DCPTEQKVLinear`) layer.
    """
    Mode(mode)
    return dense.resolved(device)


def build_model(mode: Mode, preset: ModelPreset, placement: Placement, groups: TokenParallelGroups,
                dtype: torch.dtype, device: torch.device, *,
                padded_vocab: Optional[int] = None,
                dense: DenseFormat = DenseFormat(transformer_impl="local")) -> StageModel:
    """This rank's blocks, uninitialised (fill them with :func:`load_weights`); with an FP8
    ``dense`` format the transformer layers are FP8-stored from the start.

    ``padded_vocab`` is a checkpoint's embedding rows (default: Megatron's padding).
    """
    dense = dense_format_for(mode, dense, device)
    if Mode(mode) is not Mode.DCP:
        return build_rank_model(preset, placement, groups, dtype, device, vocab_size=padded_vocab,
                                dense=dense)
    if padded_vocab is not None:
        raise ValueError("the DCP baseline builds Megatron's default vocabulary padding: "
                         "leave padded_vocab unset")
    from tknp_megatron.baselines.dcp_qkv import build_dcp_model

    return build_dcp_model(preset, range(preset.num_layers), pre_process=True, post_process=True,
                           tp=groups.tp_size, params_dtype=dtype, device=device, dense=dense)


def load_weights(model: torch.nn.Module, preset: ModelPreset, weights: Weights,
                 rounds: Optional[LayerRounds] = None) -> None:
    """Fill ``model`` (a StageModel or Megatron GPTModel) from ``weights`` (see :data:`Weights`).

    A seed or checkpoint fills a StageModel whose layers store FP8 in rounds of one layer,
    each through a staging copy in the run's dtype (:func:`~tknp_megatron.models.layer_rounds.plan_layer_rounds`),
    so the rank never holds its block in that dtype; ``rounds`` gives other rounds (for a
    checkpoint every rank passes rounds or none: the load is collective). Otherwise the model
    is filled at once.
    """
    if callable(weights):
        weights(model)
        return
    if rounds is None and isinstance(model, StageModel) and model.fp8_layers:
        rounds = plan_layer_rounds(model)
    if isinstance(weights, (str, os.PathLike)):
        from tknp_megatron.models.checkpoint import load_megatron_checkpoint

        load_megatron_checkpoint(model, weights, rounds)
    elif isinstance(weights, int) and not isinstance(weights, bool):
        if rounds is None:
            fill_seeded_(model, preset, weights)
        else:
            fill_in_rounds_(model, lambda part: fill_seeded_(part, preset, weights), rounds)
    else:
        raise TypeError(f"weights must be a seed, a checkpoint path or a loader, got {weights!r}")


def engine_config_for(mode: Mode, config: EngineConfig) -> EngineConfig:
    """``config`` as ``mode`` runs it: two microbatches for ``tknp-dual``, one for every
    other mode (ValueError otherwise). ``cuda_graphs`` is kept as given: every mode,
    DCP and PP included, replays its pure-decode steps from graphs per batch bucket."""
    mode = Mode(mode)
    if mode is Mode.TKNP_DUAL:
        return dataclasses.replace(config, microbatches=2)
    if config.microbatches != 1:
        raise ValueError(f"microbatches={config.microbatches} is mode {Mode.TKNP_DUAL.value!r}, "
                         f"not {mode.value!r}")
    return config


def build_engine(
    mode: Mode,
    preset: ModelPreset,
    groups: TokenParallelGroups,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    weights: Weights = 0,
    *,
    padded_vocab: Optional[int] = None,
    dense: DenseFormat = DenseFormat(),
    clock: Callable[[], float] = time.perf_counter,
) -> InferenceEngine:
    """This rank's engine of ``mode`` over ``groups`` (collective: every rank calls it).

    Args:
        mode: the parallel mode (a :class:`Mode` or its value).
        preset: the model.
        groups: this rank's process groups; DP, TP and DCP pools have one node.
        config: engine knobs, adjusted by :func:`engine_config_for`.
        device: this rank's device.
        dtype: parameter (and KV cache) dtype.
        weights: a seed, a checkpoint directory or a loader (:data:`Weights`).
        padded_vocab: a checkpoint's embedding rows, if not Megatron's default padding.
        dense: local or Transformer Engine layers, FP8 weights or not (default: TE where
            installed on a GPU, weights in ``dtype``).
        clock: wall clock of request timelines.
    """
    mode = Mode(mode)
    if mode in _ONE_NODE and groups.num_nodes != 1:
        raise ValueError(f"mode {mode.value!r} runs pools of one node (token_parallel_size=1), "
                         f"got {groups.num_nodes} nodes")
    engine_config = engine_config_for(mode, config)
    dense = dense_format_for(mode, dense, device)
    placement = placement_for(mode, preset, groups, dense)
    model = build_model(mode, preset, placement, groups, dtype, device, padded_vocab=padded_vocab,
                        dense=dense)
    load_weights(model, preset, weights)  # FP8 layers: one layer at a time, see load_weights
    if mode is Mode.DCP:
        from tknp_megatron.baselines.dcp import DCPInferenceEngine, init_dcp_groups

        dcp = init_dcp_groups(groups, preset.num_query_groups)
        return DCPInferenceEngine(model, preset, groups, dcp, engine_config, device, clock)
    if mode is Mode.PP:
        from tknp_megatron.baselines.pp import PPInferenceEngine

        return PPInferenceEngine(model, preset, placement, groups, engine_config, device, clock=clock)
    return TKNPInferenceEngine(model, preset, placement, groups, engine_config, device, clock)
