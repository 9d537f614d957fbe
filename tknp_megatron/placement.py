"""Balanced contiguous layer-block placement by bytes (paper 4.2 and 4.5).

One copy of the weights is cut into N contiguous layer blocks, one per node, so that the
largest per-node weight footprint is as small as possible. Bytes are counted at each
parameter's stored dtype (FP8 linear weights, BF16 norms / embedding / output layer), and
the endpoint parameters ride with their blocks: the embedding with the first block, the
final norm and output layer with the last.

Dual-active-root copy (even N): block b is stored on nodes b and (b + N/2) mod N, so node n
stores blocks n and (n - N/2) mod N, and microbatch m uses root (b + m N/2) mod N.

This module holds the byte accounting (:func:`model_bytes`) and the layout
(:class:`Placement`); the exact min-max searches over layer blocks live in
:mod:`tknp_megatron.partition` (``balance_contiguous`` is re-exported here).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

from tknp_megatron.config import ModelPreset
from tknp_megatron.partition import (
    Block,
    balance_contiguous,
    balance_pairs,
    block_sums,
    check_blocks,
)

__all__ = [
    "GIB",
    "Handoff",
    "ModelBytes",
    "Placement",
    "balance_contiguous",
    "balanced_placement",
    "model_bytes",
    "placement_from_bytes",
]

GIB = 1 << 30


class Handoff(NamedTuple):
    """The hidden state moves from ``from_node`` to ``to_node`` before ``layer`` runs."""

    layer: int
    from_node: int
    to_node: int


@dataclass(frozen=True)
class ModelBytes:
    """Weight bytes of one model copy, as stored.

    Attributes:
        layers: bytes of each transformer layer (linear weights, norms, biases).
        embedding: bytes of the word embedding (stored with the first block).
        output: bytes of the final norm plus output layer (stored with the last block).
    """

    layers: Tuple[int, ...]
    embedding: int
    output: int

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("ModelBytes needs at least one layer")
        if min(self.layers) < 0 or self.embedding < 0 or self.output < 0:
            raise ValueError("byte counts must be non-negative")

    @property
    def total(self) -> int:
        """Bytes of the whole copy."""
        return sum(self.layers) + self.embedding + self.output


def model_bytes(
    preset: ModelPreset,
    linear_bytes: int = 2,
    other_bytes: int = 2,
    *,
    attention_bytes: Optional[int] = None,
    edge_layers_at_other_bytes: int = 0,
) -> ModelBytes:
    """Per-layer and endpoint bytes of ``preset`` at the given storage sizes.

    ``linear_bytes`` applies to linear_qkv, linear_proj, linear_fc1, linear_fc2 (1 for FP8,
    2 for BF16); ``other_bytes`` to norms, biases, embedding and output layer.
    ``attention_bytes`` overrides linear_qkv / linear_proj, and the first and last
    ``edge_layers_at_other_bytes`` layers keep all their linears at ``other_bytes``; with
    ``(1, 2, attention_bytes=2, edge_layers_at_other_bytes=1)`` this is Meta's Llama 3.1 FP8
    checkpoint (FP8 MLPs in the inner layers only).
    """
    if linear_bytes < 1 or other_bytes < 1:
        raise ValueError(f"bytes per element must be >= 1, got {linear_bytes}, {other_bytes}")
    lin = preset.layer_linear_params()
    att = lin["linear_qkv"] + lin["linear_proj"]
    mlp = lin["linear_fc1"] + lin["linear_fc2"]
    other = sum(preset.layer_other_params().values()) * other_bytes
    att_bytes = linear_bytes if attention_bytes is None else attention_bytes
    inner = att * att_bytes + mlp * linear_bytes + other
    edge = (att + mlp) * other_bytes + other
    n, k = preset.num_layers, edge_layers_at_other_bytes
    layers = tuple(edge if l < k or l >= n - k else inner for l in range(n))
    return ModelBytes(
        layers=layers,
        embedding=preset.embedding_params() * other_bytes,
        output=preset.output_params() * other_bytes,
    )


@dataclass(frozen=True)
class Placement:
    """Which node stores which layer block, and which node is root for each layer.

    Attributes:
        num_nodes: N.
        num_layers: L.
        blocks: block b is layers ``[start, end)``; N contiguous non-empty blocks.
        dual: dual-active-root copy (block b on nodes b and (b + N/2) mod N).
        node_bytes: weight bytes stored per node.
    """

    num_nodes: int
    num_layers: int
    blocks: Tuple[Block, ...]
    dual: bool
    node_bytes: Tuple[int, ...]

    def __post_init__(self) -> None:
        check_blocks(self.num_layers, self.num_nodes)
        if len(self.blocks) != self.num_nodes or len(self.node_bytes) != self.num_nodes:
            raise ValueError("need one block and one byte count per node")
        edges = [0] + [e for _, e in self.blocks]
        if [s for s, _ in self.blocks] != edges[:-1] or edges[-1] != self.num_layers:
            raise ValueError(f"blocks {self.blocks} do not tile [0, {self.num_layers})")
        if any(s >= e for s, e in self.blocks):
            raise ValueError(f"empty block in {self.blocks}")
        if self.dual and self.num_nodes % 2:
            raise ValueError(f"dual copy needs an even node count, got {self.num_nodes}")
        if min(self.node_bytes) < 0:
            raise ValueError("node bytes must be non-negative")

    @property
    def copies(self) -> int:
        """Weight copies stored across the pool (1, or 2 for dual)."""
        return 2 if self.dual else 1

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} out of range [0, {self.num_nodes})")

    def _shift(self, microbatch: int) -> int:
        if microbatch not in range(self.copies):
            raise ValueError(
                f"microbatch must be in [0, {self.copies}) for "
                f"{'dual' if self.dual else 'single'} copy, got {microbatch}"
            )
        return microbatch * self.num_nodes // 2

    def block_of_layer(self, layer: int) -> int:
        """Index of the block holding global ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        return bisect.bisect_right([s for s, _ in self.blocks], layer) - 1

    def root_of_layer(self, layer: int, microbatch: int = 0) -> int:
        """Node that runs the dense part of ``layer`` for ``microbatch``."""
        return (self.block_of_layer(layer) + self._shift(microbatch)) % self.num_nodes

    def blocks_of_node(self, node: int) -> Tuple[int, ...]:
        """Blocks stored on ``node`` (sorted)."""
        self._check_node(node)
        if not self.dual:
            return (node,)
        return tuple(sorted((node, (node - self.num_nodes // 2) % self.num_nodes)))

    def layers_of_node(self, node: int) -> Tuple[int, ...]:
        """Global layer indices whose weights ``node`` stores (sorted)."""
        spans = (range(*self.blocks[b]) for b in self.blocks_of_node(node))
        return tuple(sorted(l for span in spans for l in span))

    def holds_embedding(self, node: int) -> bool:
        """``node`` stores the first block, hence the word embedding."""
        return 0 in self.blocks_of_node(node)

    def holds_output(self, node: int) -> bool:
        """``node`` stores the last block, hence the final norm and output layer."""
        return self.num_nodes - 1 in self.blocks_of_node(node)

    def first_root(self, microbatch: int = 0) -> int:
        """Root of layer 0 (embeds the new tokens)."""
        return self.root_of_layer(0, microbatch)

    def last_root(self, microbatch: int = 0) -> int:
        """Root of the last layer (computes logits and samples)."""
        return self.root_of_layer(self.num_layers - 1, microbatch)

    def handoffs(self, microbatch: int = 0) -> Tuple[Handoff, ...]:
        """Layer boundaries where the root changes, in layer order."""
        out = []
        for start, _ in self.blocks[1:]:
            src = self.root_of_layer(start - 1, microbatch)
            dst = self.root_of_layer(start, microbatch)
            if src != dst:
                out.append(Handoff(start, src, dst))
        return tuple(out)

    def describe(self) -> str:
        """A text table: node, blocks, layer ranges, GiB, endpoint parameters."""
        lines = [f"{'node':>4}  {'blocks':<8}{'layers':<16}{'GiB':>9}  endpoints"]
        for node in range(self.num_nodes):
            blocks = self.blocks_of_node(node)
            spans = ",".join(f"{self.blocks[b][0]}-{self.blocks[b][1] - 1}" for b in blocks)
            ends = ("embedding " if self.holds_embedding(node) else "") + (
                "output" if self.holds_output(node) else ""
            )
            lines.append(
                f"{node:>4}  {','.join(map(str, blocks)):<8}{spans:<16}"
                f"{self.node_bytes[node] / GIB:>9.2f}  {ends.strip() or '-'}"
            )
        return "\n".join(lines)


def placement_from_bytes(weights: ModelBytes, num_nodes: int, dual: bool = False) -> Placement:
    """Byte-balanced placement of one copy (or the dual copy) over ``num_nodes`` nodes."""
    n = len(weights.layers)
    if num_nodes > n:
        raise ValueError(f"num_nodes={num_nodes} exceeds num_layers={n}")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    if dual and (num_nodes < 2 or num_nodes % 2):
        raise ValueError(f"dual copy needs an even num_nodes >= 2, got {num_nodes}")
    fe, le = weights.embedding, weights.output
    balance = balance_pairs if dual else balance_contiguous
    blocks = balance(weights.layers, num_nodes, fe, le)
    sums = block_sums(weights.layers, blocks, fe, le)
    if dual:
        half = num_nodes // 2
        node_bytes = tuple(sums[b] + sums[(b + half) % num_nodes] for b in range(num_nodes))
    else:
        node_bytes = tuple(sums)
    return Placement(num_nodes, n, blocks, dual, node_bytes)


def balanced_placement(
    preset: ModelPreset,
    num_nodes: int,
    *,
    linear_bytes: int = 2,
    other_bytes: int = 2,
    dual: bool = False,
) -> Placement:
    """Byte-balanced placement of ``preset`` over ``num_nodes`` nodes.

    Single copy: exact minimum of the largest per-node bytes. Dual copy (even N >= 2): exact
    minimum of the largest pair sum bytes(block b) + bytes(block b + N/2), which is what each
    node stores; ties keep the single-copy optimum. See :func:`model_bytes` for the byte
    accounting.
    """
    weights = model_bytes(preset, linear_bytes, other_bytes)
    return placement_from_bytes(weights, num_nodes, dual)
