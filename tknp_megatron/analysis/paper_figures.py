"""The paper's evaluation (section 5) predicted by the pool simulator, next to its reported ratios.

Setups as in the paper: decode pools of 4 or 8 hosts of 8 H100s (TP8 inside a host, 400 Gb/s
InfiniBand per GPU), FP8 weights with selected parameters in BF16, BF16 KV, fixed-length
traces of 1,024 output tokens, modes as section 5.1 defines them (TKNP N x TP8, DP N x TP8,
TP 8N, PP N stages x TP8, DCP 8N). KV capacity per mode comes from the capacity model with
the paper's measured Llama 3.1 405B node (454 GiB of weights, 106 GiB of DP KV); Nemotron-4
340B, for which the paper gives no memory figures, gets the same 560 GiB per node and its
all-FP8-linear weight bytes. Step times are the bare roofline on H100 constants (the
paper's engine is vLLM: no implementation factor of ours applies).

Dual active roots (two weight copies, section 4.5) run on the engine's own two microbatches,
timed by the roofline's model of the paper's schedule (a root computes only its own
microbatch's attention, so dense work and attention overlap fully: the schedule's best
case) or of this repository's (where they add up). :func:`dual_table` says where the
second copy pays for its lost KV capacity.

Each headline is the paper's largest reported ratio for a comparison (``up to``), so the
prediction is the largest ratio over the grid's batches for that comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from tknp_megatron.analysis import workload as wl
from tknp_megatron.analysis.costmodel import NodeBudget, budget_from_measurement, budget_from_preset
from tknp_megatron.analysis.roofline import H100
from tknp_megatron.analysis.simulator import Calibration, kv_tokens_per_owner, simulate
from tknp_megatron.config import ModelPreset, get_preset
from tknp_megatron.mode import Mode
from tknp_megatron.placement import model_bytes

__all__ = ["DUAL_PAPER", "FIGURES", "HEADLINES", "Grid", "Headline", "dual_table", "mode_table", "paper_setup",
           "predict"]

OUTPUT_LEN = 1024
MODES = (Mode.TKNP, Mode.DP, Mode.TP, Mode.PP, Mode.DCP)


@dataclass(frozen=True)
class Headline:
    """One ratio the paper reports.

    Attributes:
        what: the comparison, in words, with its figure.
        paper: the ratio the paper reports.
        model: preset name.
        numerator, denominator: ``(mode, nodes)`` of each side (a :class:`Mode`, or
            :data:`DUAL_PAPER`).
        contexts: the contexts the paper's figure covers.
        batches: the offered batches over which the largest ratio is taken.
    """

    what: str
    paper: float
    model: str
    numerator: Tuple[Union[Mode, str], int]
    denominator: Tuple[Union[Mode, str], int]
    contexts: Tuple[int, ...]
    batches: Tuple[int, ...]


DUAL_PAPER = "tknp-dual-paper"  # Mode.TKNP_DUAL on the paper's schedule (see Grid.throughput)

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
    Headline("405B, 8 nodes, 32K: dual active roots over single copy, up to (Fig. 11)", 1.111,
             "llama3.1-405b", (DUAL_PAPER, 8), (Mode.TKNP, 8), (32768,), (32, 64, 128)),
    Headline("405B, 8 nodes, 32K: dual active roots over DCP, up to (Fig. 11)", 1.70,
             "llama3.1-405b", (DUAL_PAPER, 8), (Mode.DCP, 8), (32768,), (32, 64, 128)),
)


def paper_setup(name: str) -> Tuple[ModelPreset, NodeBudget, float]:
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


FIGURES = (  # (figure, model, nodes, contexts) whose every mode the table shows
    ("Fig. 8", "llama3.1-405b", 4, (32768, 65536, 98304)),
    ("Fig. 10", "nemotron4-340b", 4, (65536,)),
    ("Fig. 11", "llama3.1-405b", 8, (32768,)),
)
TABLE_BATCHES = (32, 64, 128)


class Grid:
    """Simulated completion throughput (tok/s) of the paper's setups, each run once."""

    def __init__(self):
        self._runs: Dict[tuple, float] = {}

    def throughput(self, model: str, mode, nodes: int, context: int, batch: int) -> float:
        """``mode`` is a :class:`Mode`, ``tknp-dual`` on this repository's dual-root schedule,
        or :data:`DUAL_PAPER`: two copies on the schedule the paper describes."""
        schedule = mode if mode == DUAL_PAPER else None
        mode = Mode.TKNP_DUAL if schedule else Mode(mode)
        key = (model, mode, schedule, nodes, context, batch)
        if key not in self._runs:
            preset, budget, elem = paper_setup(model)
            trace = wl.fixed_length(batch, context, OUTPUT_LEN, seed=0)
            kv = kv_tokens_per_owner(mode, preset, nodes, budget)
            run = simulate(mode, preset, 8 * nodes, 8, trace, kv, hw=H100, calibration=Calibration(),
                           weight_elem=elem, schedule=schedule)
            self._runs[key] = run.metrics.completion_throughput_tok_s
        return self._runs[key]


def predict(headlines: Sequence[Headline] = HEADLINES, batches: Sequence[int] = (),
            grid: Optional[Grid] = None) -> List[Dict]:
    """One row per headline: the paper's ratio, the prediction and where it peaks.
    ``batches`` overrides every grid's batches (a quick look)."""
    grid = grid or Grid()
    rows = []
    for h in headlines:
        best = None
        for ctx in h.contexts:
            for b in batches or h.batches:
                num, den = (grid.throughput(h.model, mode, nodes, ctx, b)
                            for mode, nodes in (h.numerator, h.denominator))
                if best is None or num / den > best[0]:
                    best = (num / den, ctx, b)
        rows.append(dict(what=h.what, paper=h.paper, predicted=best[0], context=best[1], batch=best[2],
                         difference=best[0] / h.paper - 1))
    return rows


def mode_table(batches: Sequence[int] = TABLE_BATCHES, grid: Optional[Grid] = None) -> List[Dict]:
    """Every mode's predicted tok/s per figure, context and batch, with TKNP over each."""
    grid = grid or Grid()
    rows = []
    for figure, model, nodes, contexts in FIGURES:
        for ctx in contexts:
            for b in batches:
                tok = {m.value: grid.throughput(model, m, nodes, ctx, b) for m in MODES}
                rows.append(dict(figure=figure, model=model, nodes=nodes, context=ctx, batch=b, tok_s=tok,
                                 tknp_over={m: tok["tknp"] / v for m, v in tok.items() if m != "tknp"}))
    return rows


def dual_table(nodes: Sequence[int] = (2, 4, 8), contexts: Sequence[int] = (32768, 65536),
               batches: Sequence[int] = TABLE_BATCHES, grid: Optional[Grid] = None) -> List[Dict]:
    """Where a second weight copy pays, on the 405B setup: per node count, context and batch,
    each copy count's KV tokens per node and tok/s, and dual over single copy on this
    repository's dual-root schedule and on the paper's."""
    grid = grid or Grid()
    preset, budget, _ = paper_setup("llama3.1-405b")
    rows = []
    for n in nodes:
        for ctx in contexts:
            for b in batches:
                single = grid.throughput("llama3.1-405b", Mode.TKNP, n, ctx, b)
                ours = grid.throughput("llama3.1-405b", Mode.TKNP_DUAL, n, ctx, b)
                paper = grid.throughput("llama3.1-405b", DUAL_PAPER, n, ctx, b)
                rows.append(dict(nodes=n, context=ctx, batch=b,
                                 kv_tokens_per_node=kv_tokens_per_owner(Mode.TKNP, preset, n, budget),
                                 dual_kv_tokens_per_node=kv_tokens_per_owner(Mode.TKNP_DUAL, preset, n, budget),
                                 single_tok_s=single, dual_over_single=ours / single,
                                 paper_dual_over_single=paper / single))
    return rows
