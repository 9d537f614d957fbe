"""Predicted decode-step time per parallel mode, from per-op costs measured on an H200.

A step gives every resident request one token. Per layer each mode pays dense work
(weight reads amortised over its batch), attention (reading the KV it holds), and its
communication; layers run in sequence. The per-op costs are calibrated on H200s
(measurements in ``benchmarks/RESULTS.md``): a Llama-70B layer's bf16 GEMMs take 400 us
up to B=32, 478 us at 64 and 619 us at 128 on one GPU (scaled by weight bytes for other
shapes and TP slices), KV is read at 4.3 TB/s, an all-reduce of
[B, D] costs 20 us + bytes / 336 GB/s, and a graphed root<->owner exchange 21 us +
bytes / 336 GB/s per direction. Benchmarks report measured / predicted per mode, so an
implementation gap is told apart from the physics.

Across hosts (a pool wider than ``Hardware.gpus_per_host``) a transfer or collective
that leaves the host runs at the per-GPU network rate instead (``net_s`` + bytes /
``net_bw``): TKNP's root <-> owner exchange, TP's and DCP's all-reduces, DCP's query
gather and partial-output merge among the hosts sharing a head (their bytes count there:
[B, Hq / host GPUs, d_h] each), PP's stage handoffs. Within a
host the model is as calibrated above. ``weight_elem`` is bytes per linear weight (1 for
FP8-stored weights: decode GEMMs read their weights, so they take half the time).

``tknp-dual-paper`` is the schedule the paper describes (a root computes only its own
microbatch's attention while it is root): the microbatches are two chains of root dense
work, exchange and owners' attention on different roots, sharing only the owners, so a
layer takes the longer of one chain and the owners' attention for both microbatches.

``tknp-dual`` models :mod:`tknp_megatron.executor.dual_root`'s schedule: per layer two half-phases,
each bounded by a root running one microbatch's dense work plus its own owner share of
the other microbatch's attention. With dense cost nearly flat in the batch this is
slower than the single-copy step; what the schedule can hide (exchange latency and the
non-root GPUs' idle time during dense work) is below this model's resolution.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields

from tknp_megatron.config import ModelPreset

__all__ = ["Hardware", "H100", "H200", "StepParts", "dense_gemm_s", "predicted_step_s", "tknp_step_parts"]


@dataclass(frozen=True)
class Hardware:
    """Per-op cost constants of one GPU type.

    Attributes:
        dense_rows: batch sizes of the dense calibration points.
        dense_s: seconds for one Llama-70B layer's GEMMs at those batch sizes (one GPU).
        dense_ref_bytes: weight bytes of that layer (bf16).
        kv_bw: bytes/s at which attention reads KV.
        link_bw: bytes/s between GPUs (NVLink, one direction).
        collective_s: fixed latency of an all-reduce.
        p2p_s: fixed latency of a graphed point-to-point exchange.
        gpus_per_host: GPUs joined by NVLink (one host).
        net_bw: bytes/s per GPU between hosts (one direction).
        net_s: fixed latency of a transfer or collective between hosts.
    """

    dense_rows: tuple = (32, 64, 128)
    dense_s: tuple = (400e-6, 478e-6, 619e-6)
    dense_ref_bytes: float = 1_711_276_032.0  # one Llama-3.1-70B layer's linear weights, bf16
    kv_bw: float = 4.3e12
    link_bw: float = 336e9
    collective_s: float = 20e-6
    p2p_s: float = 21e-6
    # The paper's hosts: 8 GPUs, one 400 Gb/s InfiniBand NIC per GPU (section 5.1). The
    # rate and latency are fitted to its Figure 4: at batch 128 on Llama 3.1 405B one
    # all-reduce over 64 GPUs (8 hosts) costs 6.5x one over the 8 GPUs of a host; with
    # this model's intra-host all-reduce (41.8 us) that is 272 us = 25 us + 8.26 MB / 33.4 GB/s,
    # about two thirds of the NIC's 50 GB/s.
    gpus_per_host: int = 8
    net_bw: float = 33.4e9
    net_s: float = 25e-6


H200 = Hardware()

# H100 SXM: NVLink 4 as on the H200, HBM3 at 3.35 TB/s against the H200's 4.8 TB/s
# (NVIDIA's data sheets). Decode GEMMs and attention read memory, so both H200
# calibrations scale by that ratio; nothing here was measured on an H100.
_HBM = 3.35 / 4.8
H100 = Hardware(dense_s=tuple(t / _HBM for t in H200.dense_s), kv_bw=H200.kv_bw * _HBM)


def hardware_for(device_name: str) -> Hardware:
    """The roofline's hardware for a GPU by its name (``torch.cuda.get_device_name()``):
    :data:`H100` for an H100, else :data:`H200` (the machine every calibration was measured on)."""
    return H100 if "H100" in device_name.upper() else H200


def dense_gemm_s(hw: Hardware, rows: float, weight_bytes: float) -> float:
    """GEMM time of ``weight_bytes`` of weights over ``rows`` rows, from the calibration."""
    if rows <= 0:
        return 0.0
    xs, ys = hw.dense_rows, hw.dense_s
    if rows <= xs[0]:
        t = ys[0]
    elif rows >= xs[-1]:
        t = ys[-1] * rows / xs[-1]
    else:
        i = bisect.bisect_left(xs, rows)
        f = (rows - xs[i - 1]) / (xs[i] - xs[i - 1])
        t = ys[i - 1] + f * (ys[i] - ys[i - 1])
    return t * weight_bytes / hw.dense_ref_bytes


def _layer_weight_bytes(preset: ModelPreset, elem: int = 2) -> float:
    return elem * sum(preset.layer_linear_params().values())


def _kv_bytes(preset: ModelPreset, tokens: float, kv_heads: float, elem: int = 2) -> float:
    """One layer's K and V bytes for ``tokens`` tokens of ``kv_heads`` heads."""
    return 2 * elem * tokens * kv_heads * preset.kv_channels


def _allreduce_s(hw: Hardware, rows: float, preset: ModelPreset, ranks: int) -> float:
    """All-reduce of a [rows, D] bf16 activation over ``ranks`` GPUs (ring volume)."""
    if ranks <= 1:
        return 0.0
    fixed, bw = (hw.collective_s, hw.link_bw) if ranks <= hw.gpus_per_host else (hw.net_s, hw.net_bw)
    return fixed + 2 * rows * preset.hidden_size * 2 * (ranks - 1) / ranks / bw


def _p2p_s(hw: Hardware, nbytes: float, across_hosts: bool) -> float:
    """One point-to-point transfer of ``nbytes`` per GPU."""
    return hw.net_s + nbytes / hw.net_bw if across_hosts else hw.p2p_s + nbytes / hw.link_bw


def _exchange_s(hw: Hardware, preset: ModelPreset, per_owner: float, tp: int, across_hosts: bool) -> float:
    """A layer's root <-> owner exchange for ``per_owner`` rows: QKV out, attention back."""
    row = (preset.qkv_width + preset.num_attention_heads * preset.kv_channels) * 2 / tp
    return 2 * _p2p_s(hw, per_owner * row, across_hosts)


def _logits_s(hw: Hardware, preset: ModelPreset, rows: float, tp: int) -> float:
    return dense_gemm_s(hw, rows, 2.0 * preset.vocab_size * preset.hidden_size / tp)


@dataclass(frozen=True)
class StepParts:
    """A TKNP (or DP) decode step's roofline, summed over its layers, in seconds: what a
    profile of the step is held against, part by part.

    Attributes:
        gemm: the layers' dense GEMMs (calibrated cuBLAS times at the batch).
        allreduce: intra-node TP's two all-reduces per layer.
        attention: the owner's KV read at ``Hardware.kv_bw``.
        exchange: the root <-> owner exchanges (none with one node).
        logits: the vocabulary GEMM.
    """

    gemm: float
    allreduce: float
    attention: float
    exchange: float
    logits: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def tknp_step_parts(preset: ModelPreset, nodes: int, tp: int, batch: float, context: float,
                    hw: Hardware = H200, weight_elem: float = 2.0) -> StepParts:
    """The parts of :func:`predicted_step_s` for ``tknp`` over ``nodes`` nodes of ``tp`` GPUs
    (one node: DP's replica, TP within it), ``batch`` requests at ``context`` tokens."""
    L, hkv = preset.num_layers, preset.num_query_groups
    w = _layer_weight_bytes(preset, weight_elem)
    per_owner = batch / nodes
    across = nodes * tp > hw.gpus_per_host
    exch = _exchange_s(hw, preset, per_owner, tp, across) if nodes > 1 else 0.0
    return StepParts(
        gemm=L * dense_gemm_s(hw, batch, w / tp), allreduce=L * 2 * _allreduce_s(hw, batch, preset, tp),
        attention=L * _kv_bytes(preset, per_owner * context, hkv / tp) / hw.kv_bw,
        exchange=L * exch, logits=_logits_s(hw, preset, batch, tp))


def predicted_step_s(
    mode: str,
    preset: ModelPreset,
    world: int,
    tp: int,
    batch: float,
    context: float,
    hw: Hardware = H200,
    weight_elem: float = 2.0,
) -> float:
    """Seconds for one decode step of ``batch`` resident requests at ``context`` tokens.

    ``world`` GPUs in all, ``tp`` per node (TKNP, DP, PP); TP and DCP use all of them.
    For DP ``batch`` is the whole pool's (split evenly over the replicas); for PP the
    step is the time for every resident request to get one token in steady state.
    """
    L, hkv = preset.num_layers, preset.num_query_groups
    w = _layer_weight_bytes(preset, weight_elem)
    nodes = world // tp
    across = world > hw.gpus_per_host
    if mode == "tknp":
        return tknp_step_parts(preset, nodes, tp, batch, context, hw, weight_elem).total
    if mode == "tknp-dual":
        # two microbatches half a layer apart: per half-phase the busiest node is a root
        # running one microbatch's dense work and its own share of the other's attention
        per_owner = batch / (2 * nodes)
        exch = _exchange_s(hw, preset, per_owner, tp, across)
        half = (dense_gemm_s(hw, batch / 2, w / tp) + 2 * _allreduce_s(hw, batch / 2, preset, tp)
                + _kv_bytes(preset, per_owner * context, hkv / tp) / hw.kv_bw + exch)
        return L * 2 * half + 2 * _logits_s(hw, preset, batch / 2, tp)
    if mode == "tknp-dual-paper":
        # the paper's arrangement: a root runs only its own microbatch's attention, so the
        # two microbatches are two chains (root dense, exchange, owners' attention) on
        # different roots that share only the owners: a layer takes the longer of one
        # chain and the owners' attention for both (the schedule's best case)
        per_owner = batch / (2 * nodes)
        exch = _exchange_s(hw, preset, per_owner, tp, across)
        dense = dense_gemm_s(hw, batch / 2, w / tp) + 2 * _allreduce_s(hw, batch / 2, preset, tp)
        attn = _kv_bytes(preset, per_owner * context, hkv / tp) / hw.kv_bw
        return L * max(dense + attn + exch, 2 * attn) + _logits_s(hw, preset, batch / 2, tp)
    if mode == "dp":  # a replica per node, each a one-node TKNP pool with its share of the batch
        return tknp_step_parts(preset, 1, tp, batch / nodes, context, hw, weight_elem).total
    if mode in ("tp", "dcp"):
        heads = hkv / world if mode == "dcp" or world <= hkv else 1.0  # TP replicates past Hkv
        layer = (dense_gemm_s(hw, batch, w / world) + 2 * _allreduce_s(hw, batch, preset, world)
                 + _kv_bytes(preset, batch * context, heads) / hw.kv_bw)
        if mode == "dcp":  # query all-gather and partial-output merge
            layer += 2 * hw.collective_s
            if across:  # among the hosts sharing a head: [B, Hq / host GPUs, d_h] each way
                hosts = world / hw.gpus_per_host
                part = batch * preset.num_attention_heads / hw.gpus_per_host * preset.kv_channels * 2
                layer += 2 * (hw.net_s + part * (hosts - 1) / hosts / hw.net_bw)
        return L * layer + _logits_s(hw, preset, batch, world)
    if mode == "pp":
        mb = batch / nodes  # about N microbatches; each stage runs L/N layers per microbatch
        layer = (dense_gemm_s(hw, mb, w / tp) + 2 * _allreduce_s(hw, mb, preset, tp)
                 + _kv_bytes(preset, mb * context, hkv / tp) / hw.kv_bw)
        handoffs = nodes * _p2p_s(hw, mb * preset.hidden_size * 2 / tp, True) if across else 0.0
        return nodes * (L / nodes) * layer + handoffs + _logits_s(hw, preset, batch, tp)
    raise ValueError(f"unknown mode {mode!r}")
