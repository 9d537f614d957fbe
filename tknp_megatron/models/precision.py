"""How the root's dense layers are built: Megatron's local modules or Transformer Engine's,
with weights in the run's dtype or stored in FP8.

The same three choices Megatron-LM offers its models, under its names:

* ``transformer_impl``: ``local`` (Megatron's local layer spec: torch norms and linears, the
  path on CPU and in CI) or ``transformer_engine`` (Megatron's TE layer spec: the input norm
  fused into the QKV GEMM, the pre-MLP norm into FC1, TE's row-parallel linears); ``auto``
  takes TE where it is installed and the run is on a GPU.
* ``fp8_recipe``: ``None`` keeps the weights in the run's dtype; a Megatron FP8 recipe
  stores the GEMM weights of every transformer layer in FP8 (Megatron's ``fp8_param``:
  the layers are built so, and weight sources fill them through a staging copy of one layer
  in the run's dtype, ``models/layer_rounds.py``) and runs those GEMMs in FP8 under TE's
  autocast. On decode the dense work is bound by reading
  weights, so half the bytes is about half the time, and the freed memory becomes KV cache.
* ``fp8_format``: ``hybrid`` or ``e4m3`` (Megatron's ``--fp8-format``; a forward pass uses
  E4M3 in both).

What stays in the run's dtype (the paper's "selected parameters retained in BF16"): the
embedding and the output layer (vocabulary-sized, precision-sensitive, and read once per
token rather than once per layer), every norm weight and bias, and the KV cache. Only the
four GEMM weights of each layer (QKV, attention output, FC1, FC2) are FP8.

Recipes served: ``tensorwise`` (per-tensor current scaling: each weight quantized once at
load with its own amax, each activation with the amax of its batch) and ``blockwise``
(128-wide blocks, each with its own scale). Refused, with the reason: ``delayed`` (its scales
come from an amax history that only training steps update, so inference would quantize with
the initial scale of 1) and ``mxfp8`` (Blackwell only).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional

import torch

__all__ = [
    "FP8_FORMATS", "FP8_RECIPES", "TRANSFORMER_IMPLS", "DenseFormat", "dense_autocast",
    "holds_fp8", "load_layer_from_", "prepare_fp8_inference_", "row_alignment",
    "store_fp8_weights_", "stored_bytes", "te_installed",
]

TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
FP8_RECIPES = ("tensorwise", "blockwise")
FP8_FORMATS = ("hybrid", "e4m3")
_REFUSED_RECIPES = {
    "delayed": "its scales come from an amax history that only training steps update, so "
               "inference would quantize with the initial scale",
    "mxfp8": "MXFP8 runs on Blackwell GPUs only",
}


def te_installed() -> bool:
    """Whether Transformer Engine's PyTorch package can be found (not imported: that
    loads CUDA libraries)."""
    return importlib.util.find_spec("transformer_engine") is not None


@dataclass(frozen=True)
class DenseFormat:
    """How this pool builds its dense layers (see the module docstring).

    Attributes:
        transformer_impl: ``auto``, ``local`` or ``transformer_engine``.
        fp8_recipe: None, or a recipe of :data:`FP8_RECIPES` (needs TE and a GPU).
        fp8_format: ``hybrid`` or ``e4m3``.
        te_fused_mlp: the MLP as TE's operation-based fused MLP (Megatron's
            ``use_te_op_fuser``: norm, FC1, activation and FC2 as one fusible sequence);
            measured by ``tknp_megatron.tools.check_fp8``; FP8 batches are padded to 16
            rows around it as around every TE linear.
    """

    transformer_impl: str = "auto"
    fp8_recipe: Optional[str] = None
    fp8_format: str = "hybrid"
    te_fused_mlp: bool = False

    def problems(self, device_type: str) -> List[str]:
        """One line per choice this run cannot make on ``device_type`` ("cpu" / "cuda"),
        naming the flag: what launchers print before any process starts."""
        out = []
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            out.append(f"--transformer-impl {self.transformer_impl}: choose one of "
                       f"{', '.join(TRANSFORMER_IMPLS)}")
        if self.fp8_format not in FP8_FORMATS:
            out.append(f"--fp8-format {self.fp8_format}: choose one of {', '.join(FP8_FORMATS)}")
        if self.fp8_recipe in _REFUSED_RECIPES:
            out.append(f"--fp8-recipe {self.fp8_recipe}: not served ({_REFUSED_RECIPES[self.fp8_recipe]}); "
                       f"choose one of {', '.join(FP8_RECIPES)}")
        elif self.fp8_recipe is not None and self.fp8_recipe not in FP8_RECIPES:
            out.append(f"--fp8-recipe {self.fp8_recipe}: choose one of {', '.join(FP8_RECIPES)}")
        wants_te = self.transformer_impl == "transformer_engine" or self.fp8_recipe is not None
        what = "--fp8-recipe" if self.fp8_recipe is not None else "--transformer-impl transformer_engine"
        if wants_te and device_type != "cuda":
            out.append(f"{what}: Transformer Engine runs on GPUs only (--device {device_type})")
        elif wants_te and not te_installed():
            out.append(f"{what}: Transformer Engine is not installed (pip install transformer-engine[pytorch])")
        if self.fp8_recipe is not None and self.transformer_impl == "local":
            out.append(f"--fp8-recipe {self.fp8_recipe}: FP8 layers are Transformer Engine's; "
                       "not with --transformer-impl local")
        return out

    def resolved(self, device: torch.device) -> "DenseFormat":
        """``auto`` made concrete for ``device``; raises ValueError on any :meth:`problems`."""
        problems = self.problems(device.type)
        if problems:
            raise ValueError("; ".join(problems))
        impl = self.transformer_impl
        if impl == "auto":
            use_te = self.fp8_recipe is not None or (device.type == "cuda" and te_installed())
            impl = "transformer_engine" if use_te else "local"
        return dataclasses.replace(self, transformer_impl=impl)

    @property
    def use_te(self) -> bool:
        """Megatron's TE layer spec (after :meth:`resolved`)."""
        return self.transformer_impl == "transformer_engine"

    @property
    def fp8(self) -> bool:
        return self.fp8_recipe is not None

    @property
    def linear_bytes(self) -> Optional[int]:
        """Bytes of a stored GEMM weight element, when not the run's dtype (FP8: 1)."""
        return 1 if self.fp8 else None

    def config_overrides(self) -> dict:
        """Megatron ``TransformerConfig`` fields for this format. ``fp8_param`` stays off in
        the model's config (a Megatron ``GPTModel`` built from it is in the run's dtype, for
        :func:`store_fp8_weights_`); a stage model builds its transformer layers under the FP8
        parameter context itself (``models/model.py: _Decoder.build_layer``)."""
        if not self.fp8:
            return {}
        return dict(fp8=self.fp8_format, fp8_recipe=self.fp8_recipe, fp8_param=False)

    def describe(self) -> str:
        impl = "TE layers" if self.use_te else "local layers"
        if self.te_fused_mlp:
            impl += " (fused MLP)"
        return f"{impl}, FP8 {self.fp8_recipe} weights" if self.fp8 else impl


def dense_autocast(config, tp_group=None):
    """TE's autocast for the dense work of a step when ``config`` (a Megatron
    ``TransformerConfig``) asks for FP8, else a null context.

    The recipe is Megatron's (``megatron.core.fp8_utils.get_fp8_recipe``); amaxes are reduced
    over the node's TP group, the ranks that run the same GEMMs.
    """
    if not getattr(config, "fp8", None):
        return nullcontext()
    import transformer_engine.pytorch as te
    from megatron.core.fp8_utils import get_fp8_recipe

    recipe = get_fp8_recipe(config)
    if hasattr(te, "autocast"):  # TE >= 2.8; fp8_autocast warns on every call there
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=tp_group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=tp_group)


def row_alignment(config) -> int:
    """Rows a step's dense batch is padded to a multiple of, once per step, for ``config`` (a
    Megatron ``TransformerConfig``); 1: not padded by the step.

    FP8 GEMMs need a row count that is a multiple of TE's alignment (TE's
    ``get_align_size_for_quantization``: 16 for the served recipes). Megatron pads each TE
    linear's input with zero rows and unpads its output (:func:`prepare_fp8_inference_`): a
    pad and an unpad kernel around each of a layer's four GEMMs, measured at 1.9 ms of a
    26 ms full-FP8 Llama-3.1-70B step at two requests. A step (TKNP, PP, DCP) instead pads
    its hidden state with zero rows once, after the embedding, and keeps them through every
    layer (``executor/dense.py: pad_rows``), so those wrappers find each batch aligned and
    pass it through.

    That is exact, the same FP8 scales and tokens as Megatron's padding, only where zero rows
    stay zero through a layer: RMSNorm (a LayerNorm's bias would make them nonzero and enter
    the per-tensor amax of FC2's input, where Megatron's padding has zeros) and no linear
    biases. Other models, and runs in the run's dtype, get 1.
    """
    if not getattr(config, "fp8", None):
        return 1
    if getattr(config, "normalization", "LayerNorm") != "RMSNorm" or getattr(config, "add_bias_linear", True):
        return 1
    from megatron.core.fp8_utils import get_fp8_recipe

    try:
        from transformer_engine.pytorch.quantization import get_align_size_for_quantization
    except ImportError:
        try:  # where earlier TE releases kept it, beside their FP8 state
            from transformer_engine.pytorch.fp8 import get_align_size_for_quantization
        except ImportError:  # a TE without it: Megatron's per-GEMM padding, which asks TE itself
            return 1
    return int(get_align_size_for_quantization(get_fp8_recipe(config)))


def holds_fp8(module: torch.nn.Module) -> bool:
    """Whether some parameter of ``module`` is a TE quantized tensor (FP8-stored)."""
    return any(type(p.data) is not torch.Tensor for p in module.parameters())


@torch.no_grad()
def load_layer_from_(layer: torch.nn.Module, source: torch.nn.Module, name: str) -> None:
    """Load ``layer`` from ``source``'s state (a layer of the same spec; ``_extra_state``
    aside). Into an FP8-stored layer this quantizes each whole GEMM weight with the
    recipe (``tensorwise``: one scale from the weight's amax), as TE does when a weight
    in the run's dtype is copied into an FP8 parameter. RuntimeError, naming ``name``,
    if the two layers' keys differ."""
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("_extra_state")}
    result = layer.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{name}: the layer does not match the one it loads from "
                           f"(missing {missing}, unexpected {result.unexpected_keys})")


def prepare_fp8_inference_(model: torch.nn.Module) -> None:
    """Megatron's ``prepare_model_for_fp8_inference`` on ``model``: each TE linear pads a
    batch whose row count is not a multiple of 16 (FP8 GEMMs need one) and unpads its
    output; TE's fused MLP, which runs its own ops rather than the wrapped linears, is
    wrapped as a whole. Wrapping twice is a no-op (Megatron keeps the wrapped set)."""
    from megatron.core.fp8_utils import prepare_model_for_fp8_inference
    # Megatron's own pad-to-16-rows wrapper (what prepare_model_for_fp8_inference applies to
    # each TE linear), here applied to the fused MLP as a whole
    from megatron.core.fp8_utils import _wrap_te_linear_for_padding

    prepare_model_for_fp8_inference(model)
    for module in model.modules():
        if type(module).__name__ == "TEFusedMLP":
            _wrap_te_linear_for_padding(module)


@torch.no_grad()
def store_fp8_weights_(model, layers=None, build_layer=None) -> None:
    """Quantize a loaded model's transformer layers to FP8-stored GEMM weights, one layer
    at a time: for a Megatron ``GPTModel`` loaded in the run's dtype (the one-GPU reference,
    ``models/reference.py``).

    Each layer is rebuilt under Megatron's FP8 parameter context (TE's
    ``quantized_model_init``: its GEMM weights are FP8 tensors, no high-precision copy) and
    loaded from the loaded layer (:func:`load_layer_from_`), which is then freed. The
    embedding, output layer, norms and biases stay as loaded. A layer already FP8-stored
    (a stage model's, built so and loaded through staging copies) is left as it is. Last,
    :func:`prepare_fp8_inference_`.

    Args:
        model: a loaded Megatron ``GPTModel`` (with the next two arguments) or
            :class:`~tknp_megatron.models.model.StageModel`, built with TE layers and an FP8
            config (:meth:`DenseFormat.config_overrides`).
        layers: the ``ModuleDict`` (keyed by global layer index) or ``ModuleList`` (indexed
            by it) of its layers; default ``model.decoder.layers``.
        build_layer: global layer index -> a new, uninitialised layer; default
            ``model.decoder.build_layer``.
    """
    from megatron.core.fp8_utils import get_fp8_context

    layers = model.decoder.layers if layers is None else layers
    build_layer = model.decoder.build_layer if build_layer is None else build_layer
    config = dataclasses.replace(model.config, fp8_param=True)
    keys = list(layers.keys()) if isinstance(layers, torch.nn.ModuleDict) else range(len(layers))
    for key in keys:
        loaded = layers[key]
        if holds_fp8(loaded):
            continue
        with get_fp8_context(config, int(key), is_init=True):
            layer = build_layer(int(key))
        load_layer_from_(layer, loaded, f"layer {key}")
        layers[key] = layer.eval()
        del loaded
    prepare_fp8_inference_(model)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the loaded layers' memory goes back to the KV cache


def stored_bytes(module: torch.nn.Module) -> int:
    """Bytes ``module``'s parameters hold on their device. An FP8 parameter (a TE quantized
    tensor, which presents itself as its high-precision dtype) counts the plain tensors it
    holds: FP8 data, a transpose if kept, scales."""
    total = 0
    for p in module.parameters():
        data = p.data
        if type(data) is torch.Tensor:
            total += data.numel() * data.element_size()
        else:
            total += sum(t.numel() * t.element_size() for t in vars(data).values()
                         if type(t) is torch.Tensor)
    return total
