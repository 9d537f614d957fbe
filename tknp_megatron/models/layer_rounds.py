"""Filling a rank's transformer layers round by round, through staging copies where the
layers store FP8.

With an FP8 format a stage model's layers are built FP8-stored from the start
(``models/model.py: _Decoder.build_layer``), so the rank's block never exists in the run's
dtype. A weight source fills it in rounds of a few layers (one by default): each round
builds a *staging copy* of its layers in the run's dtype, outside the FP8 context
(``_Decoder.staging_layer``), and describes it under the stored layers' own checkpoint keys
and layer-axis offsets (``decoder.layers.<g>.``, ``(0, g, num_layers)``;
``StageModel.sharded_state_dict(layers=...)``), so the seeded source and a checkpoint fill
it with exactly the values they would give the layer inside the model. The stored layer
then loads from the copy (:func:`~tknp_megatron.models.precision.load_layer_from_`), which
quantizes each whole weight with the recipe as before, and the copy is freed. Round 0 also
fills the endpoints (embedding, final norm, output layer: stored in the run's dtype, filled
in place). A rank's peak while loading is its stored parameters plus one round of staging
(docs/ARCHITECTURE.md, "FP8 on the root").

Without staging, the same rounds fill the model's own layers in place (how the CPU tests
run the round-by-round checkpoint load with local layers). A checkpoint load is collective
over the world and nodes hold different numbers of layers, so
:func:`~tknp_megatron.models.checkpoint.load_megatron_checkpoint` agrees on the count
first and ranks past their own rounds take part with empty ones (``num_rounds``).
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from tknp_megatron.models.model import StageModel
from tknp_megatron.models.precision import load_layer_from_

__all__ = ["LayerRounds", "fill_in_rounds_", "plan_layer_rounds"]


@dataclass(frozen=True)
class LayerRounds:
    """Which of a rank's layers each round fills, and whether through staging copies.

    Attributes:
        rounds: global layer indices per round, in order, each layer once; at least one
            round (round 0 also fills the endpoints, so a rank that holds no layer has
            ``((),)``).
        staging: fill a staging copy of each layer in the run's dtype and load the stored
            layer from it (FP8-stored layers); False fills the stored layers in place.
    """

    rounds: Tuple[Tuple[int, ...], ...]
    staging: bool

    def __post_init__(self) -> None:
        if not self.rounds:
            raise ValueError("LayerRounds.rounds: empty; give at least one round (round 0 "
                             "fills the endpoints), e.g. ((),)")
        flat = [g for r in self.rounds for g in r]
        if len(set(flat)) != len(flat):
            raise ValueError(f"LayerRounds.rounds {self.rounds}: a layer appears in more than one round")

    @property
    def layers(self) -> Tuple[int, ...]:
        """Every layer the rounds fill, sorted."""
        return tuple(sorted(g for r in self.rounds for g in r))


def _layer_bytes(layer: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``layer``'s parameters in ``dtype`` (an FP8 parameter counts its elements)."""
    return sum(p.numel() for p in layer.parameters()) * dtype.itemsize


def plan_layer_rounds(model: StageModel, round_bytes: Optional[int] = None,
                      staging: Optional[bool] = None) -> LayerRounds:
    """Rounds over ``model``'s layers in order: consecutive layers whose bytes in the run's
    dtype add up to at most ``round_bytes`` (at least one layer a round); ``None``, one
    layer a round. ``staging`` defaults to whether the layers store FP8
    (:attr:`StageModel.fp8_layers`)."""
    if round_bytes is not None and round_bytes < 1:
        raise ValueError(f"round_bytes={round_bytes}: must be >= 1 (or None: one layer a round)")
    staging = model.fp8_layers if staging is None else staging
    rounds, current, size = [], [], 0
    for g in model.layer_ids:
        nbytes = _layer_bytes(model.layer(g), model.config.params_dtype)
        if current and (round_bytes is None or size + nbytes > round_bytes):
            rounds.append(tuple(current))
            current, size = [], 0
        current.append(g)
        size += nbytes
    rounds.append(tuple(current))
    return LayerRounds(tuple(rounds), staging)


class _RoundView(torch.nn.Module):
    """One round's share of a :class:`StageModel`, under the model's own state-dict and
    checkpoint keys: ``layers`` (staging copies or the stored layers, keyed by global
    index) and, with ``endpoints``, the model's embedding, final norm and output layer.
    What a weight source sees as "the model" for a round: it has ``sharded_state_dict``
    and ``load_state_dict`` as the model has."""

    def __init__(self, model: StageModel, layers: Dict[int, torch.nn.Module], endpoints: bool):
        super().__init__()
        self.embedding = model.embedding if endpoints else None
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleDict({str(g): m for g, m in layers.items()})
        self.decoder.final_layernorm = model.decoder.final_layernorm if endpoints else None
        self.output_layer = model.output_layer if endpoints else None
        self.config = model.config
        self._describe = (model.sharded_state_dict, endpoints)  # a tuple: not a submodule

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        describe, endpoints = self._describe
        return describe(prefix, sharded_offsets, metadata, layers=self.decoder.layers,
                        endpoints=endpoints)


def _load_from_staging_(model: StageModel, layers: Dict[int, torch.nn.Module]) -> None:
    """Load each stored layer in ``layers`` (global index -> staging copy) from its copy and
    free the copies, emptying ``layers``: each copy leaves the dict as its layer loads and no
    name keeps it (a loop variable would keep the last copy alive while the next round builds
    its own: two rounds of staging at the peak). A module that references itself (a hook
    bound to it) lives on until the garbage collector runs, which it does then."""
    alive = [weakref.ref(p) for layer in layers.values() for p in layer.parameters()]
    while layers:
        g = next(iter(layers))
        load_layer_from_(model.layer(g), layers.pop(g), f"layer {g}")
    if any(ref() is not None for ref in alive):
        gc.collect()


def fill_in_rounds_(model: StageModel, fill: Callable[[torch.nn.Module], None],
                    plan: LayerRounds, num_rounds: Optional[int] = None) -> None:
    """Fill ``model`` round by round: ``fill(view)`` per round, where ``view`` is the
    round's share of the model under its keys (it has ``sharded_state_dict`` and
    ``load_state_dict``); with ``plan.staging`` the view holds fresh staging copies, each
    loaded into its stored layer after the fill and freed before the next round.

    Args:
        model: the rank's stage model; ``plan`` must cover exactly its layers.
        fill: fills a module in place (the seeded source, one collective checkpoint load).
        plan: the rounds (:func:`plan_layer_rounds`).
        num_rounds: rounds to run, at least ``len(plan.rounds)``: those past the plan's are
            empty (a collective ``fill`` still takes part); default ``len(plan.rounds)``.
    """
    if plan.layers != tuple(model.layer_ids):
        raise ValueError(f"LayerRounds covers layers {plan.layers}; the model holds {model.layer_ids}")
    count = len(plan.rounds) if num_rounds is None else num_rounds
    if count < len(plan.rounds):
        raise ValueError(f"num_rounds={num_rounds}: fewer than the plan's {len(plan.rounds)} rounds")
    for r in range(count):
        ids = plan.rounds[r] if r < len(plan.rounds) else ()
        if plan.staging:
            layers = {g: model.decoder.staging_layer(g) for g in ids}
        else:
            layers = {g: model.layer(g) for g in ids}
        fill(_RoundView(model, layers, endpoints=r == 0))
        if plan.staging:
            _load_from_staging_(model, layers)
        del layers
    if plan.staging and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the staging copies' memory goes back to the KV cache
