"""Paper-scale cost model: usable KV capacity per layout and per-layer traffic.

Pure arithmetic (no torch.distributed). Capacity follows paper section 3.2 / Figure 5,
traffic follows section 4.4, equations 1-5.

Capacity: a node offers ``node_gib`` for weights plus KV cache (after the utilisation
fraction and the runtime reserve, which every layout pays per node). A layout (a
:class:`~tknp_megatron.mode.Mode`) has as usable KV what is left after its weight copies,
divided by its KV replication:

- DP: every node holds a full copy.
- TP over all N*T GPUs: one copy, but each KV head is stored on max(1, N*T/Hkv) GPUs.
- PP, DCP, TKNP: one copy (DCP shards KV by sequence, so no replication).
- TKNP dual copy: two copies (paper 4.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from tknp_megatron.config import ModelPreset
from tknp_megatron.mode import Mode
from tknp_megatron.placement import GIB, ModelBytes, model_bytes, placement_from_bytes

__all__ = [
    "Capacity",
    "LayerTraffic",
    "Mode",
    "NodeBudget",
    "budget_from_measurement",
    "budget_from_preset",
    "gpu_gib_for_kv_ratio",
    "kv_capacity",
    "layer_traffic",
    "placement_shares",
    "split_batch",
    "tp_kv_replication",
]

KIB = 1 << 10
MIB = 1 << 20
LSE_BYTES = 4  # DCP log-sum-exp statistics are FP32


# ---------------------------------------------------------------- capacity


@dataclass(frozen=True)
class NodeBudget:
    """Memory one node offers, and what one weight copy costs.

    Attributes:
        node_gib: GiB per node for weights + KV cache (utilisation and reserve removed).
        copy_gib: GiB of one full weight copy as stored.
        gpus_per_node: T, the intra-node TP degree.
        kv_heads: Hkv, the model's KV-head count (sets TP's KV replication).
    """

    node_gib: float
    copy_gib: float
    gpus_per_node: int
    kv_heads: int

    def __post_init__(self) -> None:
        if not (self.node_gib > 0 and self.copy_gib > 0) or math.isinf(self.node_gib + self.copy_gib):
            raise ValueError(f"node_gib and copy_gib must be > 0: {self}")
        if self.gpus_per_node < 1 or self.kv_heads < 1:
            raise ValueError(f"gpus_per_node and kv_heads must be >= 1: {self}")

    @property
    def dp_kv_gib(self) -> float:
        """KV GiB left on one node that holds a full copy (may be negative: does not fit)."""
        return self.node_gib - self.copy_gib


def budget_from_preset(
    preset: ModelPreset,
    gpus_per_node: int,
    gpu_memory_gib: float,
    mem_util: float = 0.9,
    reserve_gib: float = 0.0,
    *,
    weights: Optional[ModelBytes] = None,
) -> NodeBudget:
    """Budget from a byte count: each GPU offers ``gpu_memory_gib * mem_util - reserve_gib``.

    ``weights`` defaults to ``model_bytes(preset)`` (BF16 everywhere).
    """
    if not 0 < mem_util <= 1:
        raise ValueError(f"mem_util must be in (0, 1], got {mem_util}")
    weights = weights if weights is not None else model_bytes(preset)
    per_gpu = gpu_memory_gib * mem_util - reserve_gib
    return NodeBudget(
        per_gpu * gpus_per_node, weights.total / GIB, gpus_per_node, preset.num_query_groups
    )


PAPER_KV_RATIO = 106 / 454  # the paper's DP node: 106 GiB of KV beside Llama-3.1-405B's 454 GiB FP8 copy


def gpu_gib_for_kv_ratio(weights: ModelBytes, ratio: float, gpus_per_copy: int = 1) -> float:
    """GiB per GPU at which a node holding one full weight copy over ``gpus_per_copy`` GPUs
    (a DP replica) keeps ``ratio`` times the copy's bytes for KV: a memory regime stated as
    DP's KV / weights, e.g. :data:`PAPER_KV_RATIO` (the paper's 405B FP8 on 8 x H100)."""
    if not ratio > 0:
        raise ValueError(f"the KV / weights ratio must be > 0, got {ratio}")
    if gpus_per_copy < 1:
        raise ValueError(f"gpus_per_copy must be >= 1, got {gpus_per_copy}")
    return weights.total * (1.0 + ratio) / gpus_per_copy / GIB


def budget_from_measurement(
    weights_gib: float, dp_kv_gib: float, gpus_per_node: int, kv_heads: int
) -> NodeBudget:
    """Budget from a measured DP node: ``weights_gib`` of weights and ``dp_kv_gib`` of KV.

    The node's usable memory is ``weights_gib + dp_kv_gib``; its runtime memory is outside
    both numbers and is paid again on every node in every layout.
    """
    if dp_kv_gib < 0:
        raise ValueError(f"dp_kv_gib must be >= 0, got {dp_kv_gib}")
    return NodeBudget(weights_gib + dp_kv_gib, weights_gib, gpus_per_node, kv_heads)


def tp_kv_replication(kv_heads: int, gpus: int) -> float:
    """How many GPUs hold each KV head when TP spans ``gpus``: max(1, gpus / Hkv)."""
    return max(1.0, gpus / kv_heads)


def placement_shares(weights: ModelBytes, num_nodes: int, dual: bool = False) -> Tuple[float, ...]:
    """Fraction of one weight copy each node stores under the byte-balanced placement."""
    placement = placement_from_bytes(weights, num_nodes, dual)
    return tuple(b / weights.total for b in placement.node_bytes)


@dataclass(frozen=True)
class Capacity:
    """Usable KV GiB of each layout on ``num_nodes`` nodes (``tknp_dual`` None for odd N);
    one field per :class:`~tknp_megatron.mode.Mode`, named by its :attr:`~Mode.field`."""

    num_nodes: int
    dp: float
    tp: float
    pp: float
    dcp: float
    tknp: float
    tknp_dual: Optional[float]

    def of(self, layout: Mode) -> Optional[float]:
        """GiB of ``layout`` (a :class:`Mode` or its value)."""
        return getattr(self, Mode(layout).field)

    @property
    def tknp_over_dp(self) -> Optional[float]:
        """TKNP single-copy capacity over DP's (None when DP does not fit)."""
        return self.tknp / self.dp if self.dp > 0 else None


def _free(node_gib: float, copy_gib: float, shares: Sequence[float]) -> float:
    """KV GiB left over the nodes, each storing ``share`` of a copy (never below zero)."""
    return sum(max(0.0, node_gib - copy_gib * s) for s in shares)


def kv_capacity(
    budget: NodeBudget,
    num_nodes: int,
    shares: Optional[Sequence[float]] = None,
    dual_shares: Optional[Sequence[float]] = None,
) -> Capacity:
    """Usable KV GiB per layout on ``num_nodes`` nodes of ``budget.gpus_per_node`` GPUs.

    ``shares`` / ``dual_shares``: fraction of one copy each node stores under the single /
    dual layer-block placement (see :func:`placement_shares`); equal shares when omitted.
    A node that cannot hold its share contributes nothing.
    """
    n, m, w = num_nodes, budget.node_gib, budget.copy_gib
    if n < 1:
        raise ValueError(f"num_nodes must be >= 1, got {n}")
    shares = tuple(shares) if shares is not None else (1.0 / n,) * n
    if len(shares) != n:
        raise ValueError(f"{len(shares)} shares for {n} nodes")
    even = _free(m, w, (1.0 / n,) * n)  # weights sharded evenly over all GPUs
    dual = None
    if n % 2 == 0:
        dual_shares = tuple(dual_shares) if dual_shares is not None else (2.0 / n,) * n
        dual = _free(m, w, dual_shares)
    return Capacity(
        num_nodes=n,
        dp=_free(m, w, (1.0,) * n),
        tp=even / tp_kv_replication(budget.kv_heads, n * budget.gpus_per_node),
        pp=_free(m, w, shares),
        dcp=even,
        tknp=_free(m, w, shares),
        tknp_dual=dual,
    )


# ---------------------------------------------------------------- traffic


def split_batch(batch: int, num_nodes: int) -> Tuple[int, ...]:
    """Balanced exact split of ``batch`` requests over owners; the first ones get the extra."""
    if batch < 0 or num_nodes < 1:
        raise ValueError(f"need batch >= 0 and num_nodes >= 1, got {batch}, {num_nodes}")
    q, r = divmod(batch, num_nodes)
    return tuple(q + (g < r) for g in range(num_nodes))


@dataclass(frozen=True)
class LayerTraffic:
    """Bytes per layer on one matching-rank group (paper eq. 1-5).

    Attributes:
        owner_batches: B_g per owner node.
        root: the active root (its own rows stay local).
        scatter_bytes: QKV rows sent to each owner, [B_g, (Hq + 2 Hkv) d_h / T] (0 for root).
        gather_bytes: attention outputs returned by each owner, [B_g, Hq/T, d_h] (0 for root).
        dcp_output_bytes: a DCP rank's partial output, [B, Hq/T, d_h].
        dcp_lse_bytes: a DCP rank's FP32 log-sum-exp statistics, [B, Hq/T].
        tp_allreduce_bytes: a dense TP all-reduce operand, [B, D].
    """

    owner_batches: Tuple[int, ...]
    root: int
    scatter_bytes: Tuple[int, ...]
    gather_bytes: Tuple[int, ...]
    dcp_output_bytes: int
    dcp_lse_bytes: int
    tp_allreduce_bytes: int

    @property
    def scatter_bytes_per_owner(self) -> int:
        """Largest scatter to one remote owner."""
        return max(self.scatter_bytes)

    @property
    def gather_bytes_per_owner(self) -> int:
        """Largest gather from one remote owner."""
        return max(self.gather_bytes)

    @property
    def eq3_bytes(self) -> int:
        """Paper eq. 3: scatter + gather summed over the remote owners."""
        return sum(self.scatter_bytes) + sum(self.gather_bytes)


def _local_heads(preset: ModelPreset, tp: int) -> Tuple[int, int]:
    """(query heads, KV heads) on one TP rank; KV heads replicate when T > Hkv."""
    hq, hkv = preset.num_attention_heads, preset.num_query_groups
    if tp < 1 or hq % tp or (hkv % tp and tp % hkv):
        raise ValueError(f"tp={tp} does not split {hq} query / {hkv} KV heads")
    return hq // tp, preset.local_kv_heads(tp)


def layer_traffic(
    preset: ModelPreset,
    num_nodes: int,
    tp: int,
    batch: int,
    dtype_bytes: int = 2,
    *,
    root: int = 0,
    owner_batches: Optional[Sequence[int]] = None,
) -> LayerTraffic:
    """Per-layer traffic of TKNP, DCP and dense TP for ``preset`` (paper 4.4).

    ``owner_batches`` defaults to :func:`split_batch`. When T divides Hkv, the eq. 3 total
    equals 2 s (Hq + Hkv) d_h / T * sum_{g != root} B_g.
    """
    owners = tuple(owner_batches) if owner_batches is not None else split_batch(batch, num_nodes)
    if len(owners) != num_nodes or sum(owners) != batch or min(owners) < 0:
        raise ValueError(f"owner batches {owners} do not split {batch} over {num_nodes} nodes")
    if not 0 <= root < num_nodes:
        raise ValueError(f"root {root} out of range [0, {num_nodes})")
    q_heads, kv_heads = _local_heads(preset, tp)
    d, s = preset.kv_channels, dtype_bytes
    remote = [0 if g == root else b for g, b in enumerate(owners)]
    return LayerTraffic(
        owner_batches=owners,
        root=root,
        scatter_bytes=tuple(b * (q_heads + 2 * kv_heads) * d * s for b in remote),
        gather_bytes=tuple(b * q_heads * d * s for b in remote),
        dcp_output_bytes=batch * q_heads * d * s,
        dcp_lse_bytes=batch * q_heads * LSE_BYTES,
        tp_allreduce_bytes=batch * preset.hidden_size * s,
    )
