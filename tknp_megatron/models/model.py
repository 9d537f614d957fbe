"""The part of a Megatron GPT model that one rank stores.

A node's layer block is what Megatron calls a pipeline stage, but TKNP's byte-balanced
blocks have arbitrary boundaries (and a dual-copy node stores two non-adjacent blocks),
which Megatron 0.16's ``TransformerBlock`` can only express through a layout keyed by the
*global* pipeline rank. So :class:`StageModel` assembles Megatron's own modules directly:
``LanguageModelEmbedding`` (first block), ``TransformerLayer`` built from Megatron's layer
spec with its *global* layer number, the final norm and the ``ColumnParallelLinear`` output
layer (last block). Its state-dict and sharded-state-dict keys are exactly ``GPTModel``'s
(``decoder.layers.<global>.``...), so Megatron checkpoints load block by block.

Modules are built on the meta device and only the stored blocks are materialised. With an
FP8 format the transformer layers are built FP8 from the start (never as a block in the run's
dtype) and weight sources fill them through one-layer staging copies
(:mod:`tknp_megatron.models.layer_rounds`; docs/ARCHITECTURE.md, "FP8 on the root").
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Iterable, Mapping, Optional, Sequence

import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    sharded_state_dict_default,
)

from tknp_megatron.config import ModelPreset
from tknp_megatron.models.norms import ZeroCenteredNorm
from tknp_megatron.models.precision import DenseFormat, prepare_fp8_inference_

__all__ = [
    "StageModel",
    "build_rank_model",
    "build_stage_model",
    "final_norm_spec",
    "layer_spec",
    "padded_vocab_size",
    "served_vocab_size",
]


def layer_spec(preset: ModelPreset, use_te: bool = False, te_fused_mlp: bool = False) -> ModuleSpec:
    """Megatron's GPT layer spec for ``preset``: TE spec when asked, else the local spec.

    TE's fused norm + linear layers read the norm type and zero-centred gamma from the
    config. The local spec's torch norms refuse zero-centred gamma, so for such presets the
    input, pre-MLP and (with ``qk_layernorm``) query and key norms become
    :class:`ZeroCenteredNorm`.
    """
    qk = preset.qk_layernorm
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=qk, use_te_op_fuser=te_fused_mlp)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=preset.normalization, qk_layernorm=qk)
    if preset.zero_centered_gamma:
        spec.submodules.input_layernorm = ZeroCenteredNorm
        spec.submodules.pre_mlp_layernorm = ZeroCenteredNorm
        if qk:
            attention = spec.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = ZeroCenteredNorm
    return spec


def final_norm_spec(preset: ModelPreset, use_te: bool = False):
    """The module class of the decoder's final norm for ``preset`` (TE, zero-centred, or
    the local spec's norm), as ``TransformerBlockSubmodules.layer_norm`` takes it."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    if preset.zero_centered_gamma:
        return ZeroCenteredNorm
    return gpt_layer_specs.get_gpt_layer_local_spec(
        normalization=preset.normalization
    ).submodules.input_layernorm




class _Decoder(MegatronModule):
    """``decoder`` of a GPTModel restricted to some global layers (+ final norm).

    With an FP8 config (``config.fp8`` set, :meth:`DenseFormat.config_overrides`) its layers
    are built FP8-stored (:meth:`build_layer`); :meth:`staging_layer` builds one in the run's
    dtype for a weight source to fill.
    """

    def __init__(self, config, preset, layers: Sequence[int], post_process, spec, use_te, pgc):
        super().__init__(config=config)
        self._spec, self._pgc, self._use_te = spec, pgc, use_te
        self.fp8_layers = bool(config.fp8)
        self.layers = torch.nn.ModuleDict({str(g): self.build_layer(g) for g in layers})
        if post_process:
            self.final_layernorm = build_module(
                final_norm_spec(preset, use_te),
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )
        else:
            self.final_layernorm = None

    def build_layer(self, g: int, fp8: Optional[bool] = None):
        """A new, uninitialised ``TransformerLayer`` for global layer ``g`` (0-based), on the
        current default device.

        ``fp8`` (default: :attr:`fp8_layers`) builds it under Megatron's FP8 parameter
        context (``get_fp8_context(config with fp8_param, g, is_init=True)``, TE's
        ``quantized_model_init``): its four GEMM weights are FP8 tensors, with no
        high-precision copy kept (built without autograd, so TE keeps no initial values).
        """
        fp8 = self.fp8_layers if fp8 is None else fp8
        with torch.no_grad():  # before the context: it reads whether autograd is on
            context = nullcontext()
            if fp8:
                from megatron.core.fp8_utils import get_fp8_context

                context = get_fp8_context(dataclasses.replace(self.config, fp8_param=True), g,
                                          is_init=True)
            with context:
                return build_module(self._spec, config=self.config, layer_number=g + 1,
                                    pg_collection=self._pgc)

    def staging_layer(self, g: int):
        """Global layer ``g`` in the run's dtype (never FP8), uninitialised, on the device of
        the stored layer ``g``: what a weight source fills before the stored layer loads from
        it (:mod:`tknp_megatron.models.layer_rounds`)."""
        device = next(self.layers[str(g)].parameters()).device
        if self._use_te:  # TE modules allocate on the device Megatron passes them
            with torch.device(device):
                return self.build_layer(g, fp8=False)
        with torch.device("meta"):
            layer = self.build_layer(g, fp8=False)
        return layer.to_empty(device=device)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None,
                           layers: Optional[Mapping[str, torch.nn.Module]] = None,
                           final_norm: bool = True):
        """Same keys as ``TransformerBlock.sharded_state_dict`` (layers stacked on axis 0).

        ``layers`` (keyed by global index, as :attr:`layers`) describes other modules under
        the stored layers' keys and offsets (staging copies); ``final_norm`` includes the
        final norm where held.
        """
        out = {}
        for key, layer in (self.layers if layers is None else layers).items():
            g = int(key)
            local_prefix = f"{prefix}layers.{key}."
            layer_sd = layer.sharded_state_dict(
                local_prefix, [(0, g, self.config.num_layers)], metadata
            )
            replace_prefix_for_sharding(layer_sd, local_prefix, f"{prefix}layers.")
            out.update(layer_sd)
        if final_norm and self.final_layernorm is not None:
            out.update(
                sharded_state_dict_default(
                    self.final_layernorm, f"{prefix}final_layernorm.", sharded_offsets, metadata
                )
            )
        return out


class StageModel(MegatronModule):
    """Megatron modules for the global layers ``layers`` (+ endpoints where held).

    Attributes:
        embedding: ``LanguageModelEmbedding`` or None.
        decoder.layers: ``ModuleDict`` of ``TransformerLayer`` keyed by global layer index;
            FP8-stored GEMM weights with an FP8 config (:attr:`fp8_layers`).
        decoder.final_layernorm: final norm or None.
        output_layer: vocab-parallel ``ColumnParallelLinear`` or None.
    """

    def __init__(
        self,
        preset: ModelPreset,
        config,
        layers: Iterable[int],
        pre_process: bool,
        post_process: bool,
        padded_vocab_size: int,
        use_te: bool = False,
        te_fused_mlp: bool = False,
        linear_qkv=None,
    ):
        super().__init__(config=config)
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        self.preset = preset
        self.layer_ids = tuple(sorted(layers))
        self.pre_process = pre_process
        self.post_process = post_process
        self.padded_vocab_size = padded_vocab_size
        self.embedding = None
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=padded_vocab_size,
                max_sequence_length=preset.gpt.max_sequence_length,
                position_embedding_type=preset.gpt.position_embedding_type,
                scatter_to_sequence_parallel=False,
                tp_group=pgc.tp,
            )
        spec = layer_spec(preset, use_te, te_fused_mlp)
        if use_te:  # the owners' paged attention replaces core attention: TE's would never run
            spec.submodules.self_attention.submodules.core_attention = _LOCAL_CORE_ATTENTION
        if linear_qkv is not None:  # another QKV layer (DCP's head-structured rows)
            spec.submodules.self_attention.submodules.linear_qkv = linear_qkv
        self.decoder = _Decoder(config, preset, self.layer_ids, post_process, spec, use_te, pgc)
        self.output_layer = None
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size,
                padded_vocab_size,
                config=config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                gather_output=False,
                tp_group=pgc.tp,
            )

    def layer(self, global_index: int):
        """The ``TransformerLayer`` for a global layer index."""
        return self.decoder.layers[str(global_index)]

    @property
    def fp8_layers(self) -> bool:
        """Whether the transformer layers store their GEMM weights in FP8 (built so)."""
        return self.decoder.fp8_layers

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, *,
                           layers: Optional[Mapping[str, torch.nn.Module]] = None,
                           endpoints: bool = True):
        """``GPTModel``-compatible sharded state dict of the stored parts.

        Args:
            layers: modules keyed by global layer index (as ``decoder.layers``) described
                instead of the stored layers, under the same keys and layer-axis offsets
                (one-layer staging copies, :mod:`tknp_megatron.models.layer_rounds`).
            endpoints: include the embedding, final norm and output layer where held.
        """
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = {}
        if endpoints and self.embedding is not None:
            out.update(self.embedding.sharded_state_dict(f"{prefix}embedding.", (), metadata))
        out.update(self.decoder.sharded_state_dict(f"{prefix}decoder.", (), metadata,
                                                   layers=layers, final_norm=endpoints))
        if endpoints and self.output_layer is not None:
            head = self.output_layer.sharded_state_dict(f"{prefix}output_layer.", (), metadata)
            head.pop(f"{prefix}output_layer._extra_state", None)
            if self.preset.gpt.share_embeddings_and_output_weights:
                head = _tied_to_embedding(head, prefix)
            out.update(head)
        return out


_LOCAL_CORE_ATTENTION = gpt_layer_specs.get_gpt_layer_local_spec().submodules.self_attention.submodules.core_attention


def _tied_to_embedding(head: dict, prefix: str) -> dict:
    """A tied output layer reads (and is seeded from) the embedding's checkpoint key.

    The first and last blocks sit on different nodes, so the last block stores its own
    copy of the embedding matrix as its output layer; Megatron's checkpoints of a tied
    model hold only ``embedding.word_embeddings.weight``.
    """
    key = f"{prefix}output_layer.weight"
    own = head.pop(key)
    tied = dataclasses.replace(own, key=f"{prefix}embedding.word_embeddings.weight",
                               replica_id=(1, *own.replica_id[1:]))  # not the main copy
    return {**head, key: tied}


def padded_vocab_size(preset: ModelPreset, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding: vocab rounded up to a multiple of ``divisible_by * tp``."""
    return _round_up(preset.vocab_size, divisible_by * tp)


def served_vocab_size(preset: ModelPreset, tp: int, checkpoint_rows: Optional[int] = None,
                      divisible_by: int = 128) -> int:
    """Embedding / output-layer rows of the served model at TP ``tp``.

    Without a checkpoint, Megatron-LM's padding of the preset's vocabulary. With one, its
    rows when ``tp`` divides them (the usual case: the checkpoint was padded as Megatron
    pads), else Megatron's padding at this TP (at least the checkpoint's rows): the
    loader then copies the checkpoint's rows and zero-fills the rest, and logits beyond
    the vocabulary are never sampled.
    """
    if checkpoint_rows is None:
        return padded_vocab_size(preset, tp, divisible_by)
    if checkpoint_rows % tp == 0:
        return checkpoint_rows
    return _round_up(max(checkpoint_rows, preset.vocab_size), divisible_by * tp)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_stage_model(
    preset: ModelPreset,
    layers: Iterable[int],
    *,
    pre_process: bool,
    post_process: bool,
    tp: int,
    params_dtype: torch.dtype,
    device: torch.device,
    dense: DenseFormat = DenseFormat(transformer_impl="local"),
    vocab_size: Optional[int] = None,
    linear_qkv=None,
    **config_overrides,
) -> StageModel:
    """Build the stored part, uninitialised, on ``device``.

    Local modules are built on the meta device and then allocated; TE modules allocate on
    the GPU themselves (Megatron passes them the device). With an FP8 ``dense`` format the
    transformer layers are built FP8-stored, one at a time (:meth:`_Decoder.build_layer`),
    and wrapped for FP8 inference (:func:`~tknp_megatron.models.precision.prepare_fp8_inference_`);
    the embedding, norms and output layer are in ``params_dtype``. Fill the parameters with
    :func:`tknp_megatron.engine.factory.load_weights` (FP8 layers through one-layer staging
    copies, :mod:`tknp_megatron.models.layer_rounds`). ``vocab_size`` is the checkpoint's
    embedding rows, if any (see :func:`served_vocab_size`); ``linear_qkv``, a module class
    for the layer spec's QKV projection instead of Megatron's.
    """
    dense = dense.resolved(device)
    config = preset.to_transformer_config(
        tensor_model_parallel_size=tp,
        params_dtype=params_dtype,
        use_cpu_initialization=device.type == "cpu",
        **dense.config_overrides(),
        **config_overrides,
    )
    vocab = served_vocab_size(preset, tp, vocab_size)
    if dense.use_te:
        with torch.device(device):
            model = StageModel(preset, config, layers, pre_process, post_process, vocab, True,
                               dense.te_fused_mlp, linear_qkv)
        if dense.fp8:
            prepare_fp8_inference_(model)
        return model.eval()
    with torch.device("meta"):
        model = StageModel(preset, config, layers, pre_process, post_process, vocab, False,
                           linear_qkv=linear_qkv)
    model = model.to_empty(device=device)
    return model.eval()


def build_rank_model(
    preset: ModelPreset,
    placement,
    groups,
    params_dtype: torch.dtype,
    device: torch.device,
    dense: DenseFormat = DenseFormat(transformer_impl="local"),
    **config_overrides,
) -> StageModel:
    """The blocks ``placement`` assigns to this rank's node, TP-sharded over the node."""
    node = groups.node
    return build_stage_model(
        preset,
        placement.layers_of_node(node),
        pre_process=placement.holds_embedding(node),
        post_process=placement.holds_output(node),
        tp=groups.tp_size,
        params_dtype=params_dtype,
        device=device,
        dense=dense,
        **config_overrides,
    )
