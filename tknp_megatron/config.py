"""Model presets and the TKNP run configuration.

A :class:`ModelPreset` holds every architectural field a real checkpoint needs and maps
onto Megatron-Core's :class:`TransformerConfig` plus the ``GPTModel`` arguments
(:class:`GPTArgs`). Presets are looked up by exact name with :func:`get_preset`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Callable, Dict

import torch

__all__ = [
    "Activation",
    "GPTArgs",
    "ModelPreset",
    "PRESETS",
    "get_preset",
    "dtype_from_name",
]


class Activation(str, enum.Enum):
    """MLP activation; ``gated`` in :class:`ModelPreset` turns SiLU into SwiGLU."""

    SILU = "silu"
    GELU = "gelu"
    SQUARED_RELU = "squared_relu"

    def fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The activation function Megatron's MLP applies."""
        if self is Activation.SILU:
            return torch.nn.functional.silu
        if self is Activation.GELU:
            return torch.nn.functional.gelu
        return squared_relu


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2``, as Megatron's ``squared_relu`` computes it, but not compiled.

    Megatron wraps its own in ``torch.compile`` at import: the first call, and each new
    batch shape, then compiles for seconds, which stalled the first decode steps of every
    run (queue waits of 5-9 s on a tiny model). On GPUs the executors run the activation as
    one fused kernel instead (``executor/dense_fusion.py``).
    """
    return torch.pow(torch.nn.functional.relu(x), 2)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``ValueError`` naming the choices."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class GPTArgs:
    """The ``GPTModel`` constructor arguments that are not ``TransformerConfig`` fields."""

    vocab_size: int
    max_sequence_length: int
    position_embedding_type: str = "rope"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    share_embeddings_and_output_weights: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_sequence_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r}: must be a positive integer")


@dataclass(frozen=True)
class ModelPreset:
    """A decoder-only model's architecture, in Megatron's terms.

    Attributes:
        name: preset name (``tiny``, ``llama3.1-405b``, ...).
        num_layers: transformer layers.
        hidden_size: model width D.
        num_attention_heads: query heads Hq.
        num_query_groups: KV heads Hkv (GQA groups).
        kv_channels: head dimension d_h.
        ffn_hidden_size: MLP width (per branch for gated MLPs).
        vocab_size: vocabulary (unpadded).
        gated: SwiGLU-style gated MLP (``linear_fc1`` holds gate and up).
        activation: MLP activation.
        normalization: ``RMSNorm`` or ``LayerNorm``.
        zero_centered_gamma: norm weight stored as ``gamma - 1`` (Nemotron's LayerNorm1p).
        layernorm_epsilon: norm epsilon.
        add_bias_linear: biases on the linear layers.
        add_qkv_bias: biases on the QKV projection only (Qwen2); implied by add_bias_linear.
        qk_layernorm: each query and key head normalized over its ``d_h`` channels (the
            layer's norm type) after the QKV projection, before RoPE (Megatron's
            ``qk_layernorm``; Qwen3).
        gpt: ``GPTModel`` arguments (RoPE, vocabulary, tying).
        init_std: std of the seeded random weights when no checkpoint is loaded.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    gpt: GPTArgs
    gated: bool = True
    activation: Activation = Activation.SILU
    normalization: str = "RMSNorm"
    zero_centered_gamma: bool = False
    layernorm_epsilon: float = 1e-5
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                     "ffn_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {name} {value!r}: must be a positive integer")
        if self.gpt.position_embedding_type == "rope" and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ValueError(f"{self.name}: RoPE rotates {self.rotary_dim} of the {self.kv_channels} "
                             f"channels of a head (kv_channels x rotary_percent {self.gpt.rotary_percent}): "
                             "must be even and > 0")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{self.name}: {self.num_attention_heads} heads not divisible by "
                f"{self.num_query_groups} query groups"
            )
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"{self.name}: normalization {self.normalization!r} unsupported")

    @property
    def vocab_size(self) -> int:
        return self.gpt.vocab_size

    @property
    def rotary_dim(self) -> int:
        """Channels of a head RoPE rotates, as Megatron's ``RotaryEmbedding`` counts them:
        ``int(kv_channels * rotary_percent)`` where the percent is below 1."""
        percent = self.gpt.rotary_percent
        return int(self.kv_channels * percent) if percent < 1.0 else self.kv_channels

    @property
    def qkv_width(self) -> int:
        """Columns of the fused QKV projection: (Hq + 2 Hkv) d_h."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    def replace(self, **changes) -> "ModelPreset":
        """A copy with fields changed; ``gpt`` fields may be passed flat."""
        gpt_fields = {f.name for f in dataclasses.fields(GPTArgs)}
        gpt_changes = {k: changes.pop(k) for k in list(changes) if k in gpt_fields}
        new = dataclasses.replace(self, **changes)
        if gpt_changes:
            new = dataclasses.replace(new, gpt=dataclasses.replace(new.gpt, **gpt_changes))
        return new

    def local_kv_heads(self, tp: int) -> int:
        """KV heads a TP rank stores: Hkv / T, or 1 (replicated) when T exceeds Hkv."""
        return max(1, self.num_query_groups // tp)

    def to_transformer_config(
        self,
        tensor_model_parallel_size: int = 1,
        params_dtype: torch.dtype = torch.float32,
        use_cpu_initialization: bool = True,
        **overrides,
    ):
        """Megatron ``TransformerConfig`` for inference of this preset.

        Dropout is off, fusions that need Apex/TE kernels are off, and parameters are not
        initialised by Megatron (weights come from a checkpoint or the seeded source).
        """
        from megatron.core.transformer.transformer_config import TransformerConfig

        kwargs = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels,
            ffn_hidden_size=self.ffn_hidden_size,
            normalization=self.normalization,
            layernorm_zero_centered_gamma=self.zero_centered_gamma,
            layernorm_epsilon=self.layernorm_epsilon,
            gated_linear_unit=self.gated,
            activation_func=self.activation.fn(),
            add_bias_linear=self.add_bias_linear,
            add_qkv_bias=self.add_qkv_bias,
            qk_layernorm=self.qk_layernorm,
            tensor_model_parallel_size=tensor_model_parallel_size,
            params_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            use_cpu_initialization=use_cpu_initialization,
            perform_initialization=False,
            init_method_std=self.init_std,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            rotary_interleaved=False,
        )
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    # ---- parameter counts, used by placement and the capacity / traffic reports ----

    def layer_linear_params(self) -> Dict[str, int]:
        """Weight elements of one layer's linear projections (FP8-eligible)."""
        d, f = self.hidden_size, self.ffn_hidden_size
        fc1_out = 2 * f if self.gated else f
        return {
            "linear_qkv": d * self.qkv_width,
            "linear_proj": self.num_attention_heads * self.kv_channels * d,
            "linear_fc1": d * fc1_out,
            "linear_fc2": f * d,
        }

    def layer_other_params(self) -> Dict[str, int]:
        """Elements of one layer's norms and biases (kept in BF16)."""
        d = self.hidden_size
        per_norm = 2 * d if self.normalization == "LayerNorm" else d
        out = {"input_layernorm": per_norm, "pre_mlp_layernorm": per_norm}
        if self.qk_layernorm:  # one norm for the query heads, one for the key heads, over d_h
            out["qk_layernorm"] = 2 * (per_norm // d) * self.kv_channels
        if self.add_bias_linear:
            fc1_out = 2 * self.ffn_hidden_size if self.gated else self.ffn_hidden_size
            out["biases"] = self.qkv_width + d + fc1_out + d
        elif self.add_qkv_bias:
            out["biases"] = self.qkv_width
        return out

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def output_params(self) -> int:
        """Output layer plus the final norm. A tied output layer counts too: the last block
        stores its own copy of the embedding (the first block sits on another node)."""
        d = self.hidden_size
        final_norm = 2 * d if self.normalization == "LayerNorm" else d
        return self.vocab_size * d + final_norm

    def total_params(self) -> int:
        per_layer = sum(self.layer_linear_params().values()) + sum(
            self.layer_other_params().values()
        )
        return self.num_layers * per_layer + self.embedding_params() + self.output_params()


def _llama31(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelPreset:
    return ModelPreset(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=8,
        kv_channels=128,
        ffn_hidden_size=ffn,
        gated=True,
        activation=Activation.SILU,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gpt=GPTArgs(
            vocab_size=128256,
            max_sequence_length=131072,
            rotary_base=500000,
            rope_scaling=True,
            rope_scaling_factor=8.0,
        ),
    )


PRESETS: Dict[str, ModelPreset] = {
    # Tests: Llama-style (SwiGLU, RMSNorm, GQA 4/2).
    "tiny": ModelPreset(
        name="tiny",
        num_layers=6,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=160,
        init_std=0.1,
        gpt=GPTArgs(vocab_size=512, max_sequence_length=1024, rotary_base=10000),
    ),
    # Tests: Qwen3-style (QK layernorm; a head dim of 32 beside a width of 64 over 4 heads).
    "tiny-qk": ModelPreset(
        name="tiny-qk",
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,
        ffn_hidden_size=160,
        qk_layernorm=True,
        init_std=0.1,
        gpt=GPTArgs(vocab_size=512, max_sequence_length=1024, rotary_base=1000000),
    ),
    # Tests: Nemotron-style (squared ReLU, non-gated, LayerNorm1p, rotary_percent 0.5).
    "tiny-nemotron": ModelPreset(
        name="tiny-nemotron",
        num_layers=5,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=192,
        gated=False,
        activation=Activation.SQUARED_RELU,
        normalization="LayerNorm",
        zero_centered_gamma=True,
        init_std=0.1,
        gpt=GPTArgs(
            vocab_size=512, max_sequence_length=1024, rotary_percent=0.5, rotary_base=10000
        ),
    ),
    "llama3.1-8b": _llama31("llama3.1-8b", 32, 4096, 32, 14336),
    "llama3.1-70b": _llama31("llama3.1-70b", 80, 8192, 64, 28672),
    "llama3.1-405b": _llama31("llama3.1-405b", 126, 16384, 128, 53248),
    "nemotron4-340b": ModelPreset(
        name="nemotron4-340b",
        num_layers=96,
        hidden_size=18432,
        num_attention_heads=96,
        num_query_groups=8,
        kv_channels=192,
        ffn_hidden_size=73728,
        gated=False,
        activation=Activation.SQUARED_RELU,
        normalization="LayerNorm",
        zero_centered_gamma=True,
        layernorm_epsilon=1e-5,
        gpt=GPTArgs(
            vocab_size=256000,
            max_sequence_length=4096,
            rotary_percent=0.5,
            rotary_base=10000,
        ),
    ),
}


def get_preset(name: str) -> ModelPreset:
    """The preset called exactly ``name``; ``ValueError`` lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
