"""The paper's evaluation (section 5) predicted by the pool simulator, next to its reported ratios.

Setups as in the paper: decode pools of 4 or 8 hosts of 8 H100s (TP8 inside a host, 400 Gb/s
InfiniBand per GPU), FP8 weights with selected parameters in BF16, BF16 KV, fixed-length
traces of 1,024 output tokens, modes as section 5.1 defines them (TKNP N x TP8, DP N x TP8,
TP 8N, PP N stages x TP8, DCP 8N). KV capacity per mode comes from the capacity model with
the paper's measured Llama 3.1 405B node (454 GiB of weights, 106 GiB of DP KV); Nemotron-4
340B, for which the paper gives no memory figures, gets the same 560 GiB per node and its
all-FP8-linear weight bytes. Step times are the bare roofline on H100 constants (the
paper's engine is vLLM: no implementation factor of ours applies).

Each headline is the paper's largest reported ratio for a comparison (``up to``), so the
prediction is the largest ratio over the grid's batches for that comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from tknp_megatron.analysis import workload as wl
from tknp_megatron.analysis.costmodel import budget_from_measurement, budget_from_preset
from tknp_megatron.analysis.roofline import H100
from tknp_megatron.analysis.simulator import Calibration, kv_tokens_per_owner, simulate
from tknp_megatron.config import ModelPreset, get_preset
from tknp_megatron.mode import Mode
from tknp_megatron.placement import model_bytes

__all__ = ["HEADLINES", "Headline", "predict"]

OUTPUT_LEN = 1024
MODES = (Mode.TKNP, Mode.DP, Mode.TP, Mode.PP, Mode.DCP)


@dataclass(frozen=True)
class Headline:
    """One ratio the paper reports.

    Attributes:
        what: the comparison, in words, with its figure.
        paper: the ratio the paper reports.
        model: preset name.
        numerator, denominator: ``(mode, nodes)`` of each side.
        contexts: the contexts the paper's figure covers.
        batches: offered batches of the grid (None: the largest only, as the paper states).
    """

    what: str
    paper: float
    model: str
    numerator: Tuple[Mode, int]
    denominator: Tuple[Mode, int]
    contexts: Tuple[int, ...]
    batches: Tuple[int, ...]


HEADLINES = (
    Headline("405B, 4 nodes: TKNP over DP, up to (Fig. 8: 32K / 64K / 96K)", 2.06, "llama3.1-405b",
             (Mode.TKNP, 4), (Mode.DP, 4), (32768, 65536, 98304), (32, 64, 128)),
    Headline("Nemotron-4 340B, 4 nodes, 64K: TKNP over DP, up to (Fig. 10)", 1.54, "nemotron4-340b",
             (Mode.TKNP, 4), (Mode.DP, 4), (65536,), (32, 64, 128)),
    Headline("Nemotron-4 340B, 4 nodes, 64K: TKNP over DCP, up to (Fig. 10)", 1.32, "nemotron4-340b",
             (Mode.TKNP, 4), (Mode.DCP, 4), (65536,), (32, 64, 128)),
    Headline("405B, 8 nodes, 32K: TKNP over DCP, up to (Fig. 11)", 1.53, "llama3.1-405b",
             (Mode.TKNP, 8), (Mode.DCP, 8), (32768,), (32, 64, 128)),
    Headline("405B, 32K, B=128: TKNP on 8 nodes over 4 (section 5.2)", 1.81, "llama3.1-405b",
             (Mode.TKNP, 8), (Mode.TKNP, 4), (32768,), (128,)),
    Headline("405B, 32K, B=128: DCP on 8 nodes over 4 (section 5.2)", 1.37, "llama3.1-405b",
             (Mode.DCP, 8), (Mode.DCP, 4), (32768,), (128,)),
)


def _setup(name: str) -> Tuple[ModelPreset, object, float]:
    """``(preset, node budget, bytes per linear weight)`` of a paper model on TP8 hosts."""
    preset = get_preset(name).replace(max_sequence_length=131072)  # Nemotron: linear RoPE scaling
    linear = preset.layer_linear_params()
    if name == "llama3.1-405b":
        # Meta's FP8 checkpoint: FP8 MLPs, attention projections in BF16 (the paper's 454 GiB)
        budget = budget_from_measurement(454.0, 106.0, 8, preset.num_query_groups)
        attention = linear["linear_qkv"] + linear["linear_proj"]
        elem = (2 * attention + (sum(linear.values()) - attention)) / sum(linear.values())
    else:
        copy = model_bytes(preset, linear_bytes=1, other_bytes=2)  # every linear weight FP8
        budget = budget_from_preset(preset, 8, 560.0 / 8, 1.0, weights=copy)
        elem = 1.0
    return preset, budget, elem


def _throughput(preset, budget, elem, mode: Mode, nodes: int, context: int, batch: int) -> float:
    trace = wl.fixed_length(batch, context, OUTPUT_LEN, seed=0)
    kv = kv_tokens_per_owner(mode, preset, nodes, budget)
    run = simulate(mode, preset, 8 * nodes, 8, trace, kv, hw=H100, calibration=Calibration(),
                   weight_elem=elem)
    return run.metrics.completion_throughput_tok_s


def predict(headlines: Sequence[Headline] = HEADLINES, batches: Sequence[int] = ()) -> List[Dict]:
    """One row per headline: the paper's ratio, the prediction and where it peaks.
    ``batches`` overrides every grid's batches (a quick look)."""
    cache: Dict[tuple, float] = {}
    rows = []
    for h in headlines:
        preset, budget, elem = _setup(h.model)
        best = None
        for ctx in h.contexts:
            for b in batches or h.batches:
                sides = []
                for mode, nodes in (h.numerator, h.denominator):
                    key = (h.model, mode, nodes, ctx, b)
                    if key not in cache:
                        cache[key] = _throughput(preset, budget, elem, mode, nodes, ctx, b)
                    sides.append(cache[key])
                ratio = sides[0] / sides[1]
                if best is None or ratio > best[0]:
                    best = (ratio, ctx, b)
        rows.append(dict(what=h.what, paper=h.paper, predicted=best[0], context=best[1], batch=best[2],
                         difference=best[0] / h.paper - 1))
    return rows
