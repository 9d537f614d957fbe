"""Transformer Engine layers and FP8-stored weights on the root, checked and timed on one GPU.

    torchrun --nproc-per-node 1 -m tknp_megatron.tools.check_fp8 --out $OUT/fp8.json

Formats (``--formats``): ``local`` (Megatron's local layers, weights in BF16), ``te`` (its TE
layers, BF16), ``fp8`` / ``fp8-blockwise`` (TE layers, FP8-stored GEMM weights, recipe
tensorwise / blockwise). Three parts, each printed as a table and written to ``--out``:

1. Tokens. Seeded weights of ``--model`` cut to ``--layers`` layers; ``--requests`` random
   prompts of ``--prompt-len`` tokens, greedy, ``--output-len`` tokens, through a TKNP engine
   per format (and, for FP8, once more with CUDA graphs). Each format is compared with
   Megatron's own ``GPTModel`` built with the same spec (local or TE), format and weights
   (one batched forward over the prompts): the first generated token of every request,
   and the largest difference of its logits. Every format is compared with ``local``: token agreement,
   first-token agreement and first-token logit error. Random weights have near-tied
   logits, so agreement between formats understates what a trained model gives.
2. Memory. Per format, on ``--capacity-model`` cut to ``--capacity-layers`` layers under
   ``--gpu-memory-cap-gib``: the bytes the placement predicts for the node, the bytes the
   engine reports its parameters hold, the memory allocated by building and loading them
   (measured), the KV capacity in tokens, and the peak allocated while building and loading
   the model (``load_peak_gib``, seeded weights) against the bound it must stay under
   (``load_bound_gib``: the placement's bytes, i.e. the FP8 or BF16 block with the BF16
   endpoints, plus one layer in the run's dtype, the staging copy, plus the seeded fill's
   working memory; docs/ARCHITECTURE.md, "FP8 on the root").
3. Speed. One ``--dense-model`` layer's dense work (fused norm + QKV, attention output
   projection, residual, norm + MLP; attention excluded) at each ``--batches``, captured in
   a CUDA graph, per format, as the engine runs it (fused element-wise kernels;
   ``tools/bench_dense.py`` sets it beside Megatron's modules): microseconds, the weight-read
   floor and the ratio to ``te``.

``--no-fused-elementwise`` runs the engines of parts 1, modes and dcp with Megatron's modules
between the GEMMs, as Megatron's ``GPTModel`` reference runs them.

``--parts modes`` also runs every mode that fits one GPU (TKNP, DP, TP, PP) with the last
format, CUDA graphs on. ``--parts dcp`` runs DCP, whose head-structured QKV is its own
layer, per format on the model's one-KV-head variant (DCP's rows need W >= Hkv; here W = 1):
its first-token logits against Megatron's GPTModel of that variant and format, its tokens
against TKNP's on the same variant and format, and with CUDA graphs against eager. ``--load`` and ``--expected`` serve a checkpoint (e.g. a trained
model) and given prompts, and compare with given tokens (e.g. ``transformers``' greedy).
``--device cpu`` runs parts 1 and modes with ``--formats local`` only (a smoke test of this
script: Transformer Engine needs a GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings
from typing import Dict, List

import torch

from tknp_megatron.cli import ArgumentParser
from tknp_megatron.models.precision import DenseFormat

FORMATS: Dict[str, DenseFormat] = {
    "local": DenseFormat("local"),
    "te": DenseFormat("transformer_engine"),
    "fp8": DenseFormat("transformer_engine", "tensorwise"),
    "fp8-blockwise": DenseFormat("transformer_engine", "blockwise"),
    "fp8-fused-mlp": DenseFormat("transformer_engine", "tensorwise", te_fused_mlp=True),
    "te-fused-mlp": DenseFormat("transformer_engine", te_fused_mlp=True),
    "fp8-blockwise-fused-mlp": DenseFormat("transformer_engine", "blockwise", te_fused_mlp=True),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["local", "te", "fp8", "fp8-blockwise"],
                   choices=list(FORMATS))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", default=None, metavar="DIR",
                   help="parts 1, modes and dcp: a Megatron checkpoint (e.g. a trained model) instead of seeded weights")
    p.add_argument("--expected", default=None, metavar="FILE",
                   help='parts 1 and modes: {"prompts": [[ids]], "tokens": [[ids]]} (e.g. transformers\' '
                        "greedy tokens): serve these prompts, as many tokens as expected, and compare")
    p.add_argument("--capacity-model", default="llama3.1-70b")
    p.add_argument("--capacity-layers", type=int, default=12)
    p.add_argument("--gpu-memory-cap-gib", type=float, default=34.6)
    p.add_argument("--dense-model", default="llama3.1-70b")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--parts", nargs="+", default=["tokens", "memory", "speed"],
                   choices=("tokens", "modes", "dcp", "memory", "speed"))
    p.add_argument("--no-fused-elementwise", action="store_true",
                   help="engines run the element-wise steps between the GEMMs on Megatron's modules "
                        "(EngineConfig.fused_elementwise), as the GPTModel reference does")
    p.add_argument("--no-fused-rope", action="store_true",
                   help="with the fused kernels, Megatron's RoPE and K/V append instead of one kernel "
                        "per layer (EngineConfig.fused_rope)")
    p.add_argument("--out", default=None, metavar="FILE")
    args = p.parse_args(argv)
    from tknp_megatron.analysis.bench_traces import layers_problem, model_problems

    problems = []
    for flag, name in (("--model", args.model), ("--capacity-model", args.capacity_model),
                       ("--dense-model", args.dense_model)):
        problems += model_problems(name, flag=flag)
    for flag, model, layers in (("--layers", args.model, args.layers),
                                ("--capacity-layers", args.capacity_model, args.capacity_layers)):
        if layers_problem(model, layers):
            problems.append(layers_problem(model, layers).replace("--layers", flag, 1))
    if args.device == "cuda" and not torch.cuda.is_available():
        problems.append("--device cuda: no CUDA device on this machine (--device cpu runs the token parts)")
    if problems:
        p.error("; ".join(problems))
    if args.device == "cpu":
        args.formats = ["local"]
        args.parts = [p for p in args.parts if p in ("tokens", "modes", "dcp")]
    return args


def _free(device: torch.device) -> None:
    gc.unfreeze()  # an engine froze the heap it was built with (EngineConfig.freeze_gc)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- part 1
class _Work:
    """What part 1 serves: the model (preset, weights) and the requests."""

    def __init__(self, args):
        from tknp_megatron.config import get_preset
        from tknp_megatron.models.source import resolve_source

        self.expected = None
        if args.load:
            source = resolve_source(load=args.load)
            self.preset, self.weights, self.padded_vocab = source.preset, source.checkpoint, source.padded_vocab
            self.name = f"{args.load} (trained)"
        else:
            self.preset = get_preset(args.model).replace(num_layers=args.layers)
            self.weights, self.padded_vocab = args.seed, None
            self.name = f"{args.model} x {args.layers} layers (seeded random weights)"
        if args.expected:
            with open(args.expected, encoding="utf-8") as f:
                data = json.load(f)
            self.prompts, self.expected = data["prompts"], data["tokens"]
            self.lengths = [len(t) for t in self.expected]
        else:
            gen = torch.Generator().manual_seed(args.seed)
            self.prompts = torch.randint(0, self.preset.vocab_size, (args.requests, args.prompt_len),
                                         generator=gen).tolist()
            self.lengths = [args.output_len] * args.requests


def _engine_tokens(work: _Work, mode, groups, fmt, device, dtype, args, cuda_graphs=False,
                   attention_backend=None):
    """``(tokens per request, [R, vocab] first-token logits or None)`` of ``mode``'s engine."""
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import build_engine
    from tknp_megatron.sampling import SamplingParams

    kv = None
    if device.type != "cuda":  # every request's tokens resident at once, each in whole blocks
        block = EngineConfig.block_size
        kv = sum(-(-(len(p) + n) // block) * block for p, n in zip(work.prompts, work.lengths))
    config = EngineConfig(kv_tokens_per_node=kv, gpu_memory_cap_gib=args.gpu_memory_cap_gib,
                          record_logits=not cuda_graphs, cuda_graphs=cuda_graphs,
                          fused_elementwise=False if args.no_fused_elementwise else None,
                          fused_rope=not args.no_fused_rope, attention_backend=attention_backend)
    engine = build_engine(mode, work.preset, groups, config, device, dtype, weights=work.weights,
                          padded_vocab=work.padded_vocab, dense=fmt)
    results = engine.generate(work.prompts, [SamplingParams(max_new_tokens=n) for n in work.lengths])
    tokens = [list(r.tokens) for r in results]
    first = None if cuda_graphs else torch.stack([r.logits[0] for r in results]).float().cpu()
    del engine, results
    _free(device)
    return tokens, first


def _megatron_first_logits(work: _Work, fmt, device, dtype) -> torch.Tensor:
    """``[R, vocab]``: Megatron's own GPTModel (this format's spec and weights), the last
    prompt position's logits, prompts of one length in one forward."""
    from megatron.core import parallel_state as mpu

    from tknp_megatron.engine.factory import load_weights
    from tknp_megatron.executor.rope import Rope
    from tknp_megatron.models.reference import build_reference_model, reference_to_fp8

    preset = work.preset
    mpu.initialize_model_parallel(1)
    model = build_reference_model(preset, dtype, device, vocab_size=work.padded_vocab, dense=fmt)
    load_weights(model, preset, work.weights)
    if fmt.fp8:
        model = reference_to_fp8(model, preset)
    rope = Rope(preset, model.config, device)
    out = torch.empty(len(work.prompts), preset.vocab_size)
    by_length: Dict[int, List[int]] = {}
    for i, p in enumerate(work.prompts):
        by_length.setdefault(len(p), []).append(i)
    with torch.no_grad():
        for length, rows in by_length.items():
            ids = torch.tensor([work.prompts[i] for i in rows], device=device)  # [r, S]
            hidden = model.embedding(ids, position_ids=None)  # [S, r, h]
            freqs = rope.freqs(torch.arange(length, device=device))
            hidden = model.decoder(hidden, attention_mask=None, rotary_pos_emb=freqs)
            tied = model.share_embeddings_and_output_weights
            weight = model.shared_embedding_or_output_weight() if tied else None
            logits, _ = model.output_layer(hidden[-1:], weight=weight)  # [1, r, V]
            out[rows] = logits[0, :, : preset.vocab_size].float().cpu()
    del model
    mpu.destroy_model_parallel()
    _free(device)
    return out


def _agreement(a: List[List[int]], b: List[List[int]]) -> dict:
    same = sum(x == y for ta, tb in zip(a, b) for x, y in zip(ta, tb))
    total = sum(max(len(ta), len(tb)) for ta, tb in zip(a, b))
    first = sum(ta[:1] == tb[:1] for ta, tb in zip(a, b))
    return dict(token_agreement=same / max(1, total), first_token_agreement=first / max(1, len(a)))


def tokens_part(args, device, dtype) -> List[dict]:
    import parallel_state as ps
    from tknp_megatron.mode import Mode

    work = _Work(args)
    rows, base = [], None
    for name in args.formats:
        fmt = FORMATS[name]
        row = dict(format=name, dense=fmt.resolved(device).describe(), model=work.name)
        groups = ps.initialize_model_parallel(tensor_model_parallel_size=1)
        try:
            tokens, first = _engine_tokens(work, Mode.TKNP, groups, fmt, device, dtype, args)
            graphed = None
            if fmt.fp8:
                graphed, _ = _engine_tokens(work, Mode.TKNP, groups, fmt, device, dtype, args, cuda_graphs=True)
        except Exception as err:  # noqa: BLE001 - a format this model cannot take: say so, go on
            rows.append(dict(row, error=f"{type(err).__name__}: {str(err)[:300]}"))
            print(json.dumps(rows[-1]), flush=True)
            ps.destroy_model_parallel()
            _free(device)
            continue
        ps.destroy_model_parallel()
        ref = _megatron_first_logits(work, fmt, device, dtype)  # Megatron's model, same format
        row.update(megatron_first_token_agreement=float((ref.argmax(-1) == first.argmax(-1)).float().mean()),
                   megatron_first_logit_max_diff=float((ref - first).abs().max()))
        if work.expected is not None:
            row["vs_expected"] = _agreement(tokens, work.expected)
        if graphed is not None:
            row["graphs_vs_eager"] = _agreement(graphed, tokens)["token_agreement"]
        if base is None:
            base = (tokens, first)
        else:
            diff = (first - base[1]).abs()
            row.update(vs_first_format=_agreement(tokens, base[0]),
                       vs_first_format_logit_max_diff=float(diff.max()),
                       vs_first_format_logit_mean_diff=float(diff.mean()))
        row["tokens"] = tokens
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    return rows


def modes_part(args, device, dtype) -> List[dict]:
    """Every mode that fits one GPU (TKNP, DP, TP, PP as one pool of one rank) with the last
    of ``--formats`` and CUDA graphs where the mode takes them: its tokens against TKNP's
    eager tokens (and the expected tokens, if given)."""
    import parallel_state as ps
    from tknp_megatron.mode import Mode

    work = _Work(args)
    fmt = FORMATS[args.formats[-1]]
    rows, base = [], None
    for mode in (Mode.TKNP, Mode.DP, Mode.TP, Mode.PP):
        groups = ps.initialize_model_parallel(tensor_model_parallel_size=1)
        if base is None:
            base, _ = _engine_tokens(work, Mode.TKNP, groups, fmt, device, dtype, args)
        tokens, _ = _engine_tokens(work, mode, groups, fmt, device, dtype, args,
                                   cuda_graphs=device.type == "cuda")
        ps.destroy_model_parallel()
        row = dict(mode=mode.value, format=args.formats[-1], vs_tknp_eager=_agreement(tokens, base))
        if work.expected is not None:
            row["vs_expected"] = _agreement(tokens, work.expected)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def dcp_part(args, device, dtype) -> List[dict]:
    """DCP per format on the one-KV-head variant of the model (a checkpoint as it is: its
    KV heads must not exceed the pool's one rank): first-token logits against Megatron's
    GPTModel of the same variant, format and weights (and TKNP's against it, the yardstick);
    tokens against TKNP's; CUDA graphs (on a GPU) against eager."""
    import parallel_state as ps
    from tknp_megatron.mode import Mode

    work = _Work(args)
    if not args.load:
        work.preset = work.preset.replace(num_query_groups=1)
        work.name += ", 1 KV head"
    rows = []
    for name in args.formats:
        fmt = FORMATS[name]
        row = dict(format=name, dense=fmt.resolved(device).describe(), model=work.name)
        groups = ps.initialize_model_parallel(tensor_model_parallel_size=1)
        tokens, first = _engine_tokens(work, Mode.DCP, groups, fmt, device, dtype, args)
        tknp, tknp_first = _engine_tokens(work, Mode.TKNP, groups, fmt, device, dtype, args)
        # TKNP with the fp32 reference attention, DCP's precision (its partial attention and
        # merge run in fp32): how far attention's rounding alone moves the FP8 logits
        _, tknp32_first = _engine_tokens(work, Mode.TKNP, groups, fmt, device, dtype, args,
                                         attention_backend="torch")
        graphed = None
        if device.type == "cuda":
            graphed, _ = _engine_tokens(work, Mode.DCP, groups, fmt, device, dtype, args, cuda_graphs=True)
        ps.destroy_model_parallel()
        ref = _megatron_first_logits(work, fmt, device, dtype)
        row.update(megatron_first_token_agreement=float((ref.argmax(-1) == first.argmax(-1)).float().mean()),
                   megatron_first_logit_max_diff=float((ref - first).abs().max()),
                   vs_tknp=_agreement(tokens, tknp), vs_tknp_first_logit_max_diff=float((first - tknp_first).abs().max()),
                   tknp_megatron_first_token_agreement=float((ref.argmax(-1) == tknp_first.argmax(-1)).float().mean()),
                   tknp_megatron_first_logit_max_diff=float((ref - tknp_first).abs().max()),
                   tknp_fp32_attention_megatron_first_token_agreement=float(
                       (ref.argmax(-1) == tknp32_first.argmax(-1)).float().mean()),
                   tknp_fp32_attention_megatron_first_logit_max_diff=float((ref - tknp32_first).abs().max()),
                   vs_tknp_fp32_attention_first_logit_max_diff=float((first - tknp32_first).abs().max()))
        if graphed is not None:
            row["graphs_vs_eager"] = _agreement(graphed, tokens)["token_agreement"]
        if work.expected is not None:
            row["vs_expected"] = _agreement(tokens, work.expected)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# --------------------------------------------------------------------------- part 2
_FILL_WORKING_BYTES = 64 << 20  # the seeded fill's hash slabs (models/weights.SLAB_ELEMENTS)


def _load_peak(preset, placement, groups, fmt, device, dtype, seed) -> int:
    """Bytes allocated at the peak of building this rank's model and loading seeded weights
    into it (``build_model`` + ``load_weights``, as ``build_engine`` runs them), above what
    was allocated before."""
    from tknp_megatron.engine.factory import Mode, build_model, load_weights

    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model = build_model(Mode.TKNP, preset, placement, groups, dtype, device, dense=fmt)
    load_weights(model, preset, seed)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del model
    _free(device)
    return peak


def memory_part(args, device, dtype) -> List[dict]:
    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine, placement_for
    from tknp_megatron.placement import model_bytes

    preset = get_preset(args.capacity_model).replace(num_layers=args.capacity_layers)
    staging = max(model_bytes(preset, dtype.itemsize, dtype.itemsize).layers)  # one layer, run's dtype
    rows = []
    for name in args.formats:
        fmt = FORMATS[name]
        groups = ps.initialize_model_parallel(tensor_model_parallel_size=1)
        placement = placement_for(Mode.TKNP, preset, groups, fmt.resolved(device))
        predicted = placement.node_bytes[0]
        peak = _load_peak(preset, placement, groups, fmt, device, dtype, args.seed)
        bound = predicted + staging + _FILL_WORKING_BYTES
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        config = EngineConfig(gpu_memory_cap_gib=args.gpu_memory_cap_gib)
        engine = build_engine(Mode.TKNP, preset, groups, config, device, dtype, weights=args.seed,
                              dense=fmt)
        torch.cuda.synchronize(device)
        kv_bytes = engine.kv.spec.bytes_per_block * engine.kv.spec.num_blocks
        row = dict(format=name, model=f"{args.capacity_model} x {args.capacity_layers} layers",
                   cap_gib=args.gpu_memory_cap_gib, placement_gib=predicted / 2**30,
                   reported_gib=engine.weight_bytes / 2**30,
                   allocated_gib=(torch.cuda.memory_allocated(device) - before - kv_bytes) / 2**30,
                   kv_capacity_tokens=engine.kv_capacity_tokens[0],
                   load_peak_gib=peak / 2**30, load_bound_gib=bound / 2**30,
                   load_peak_within_bound=peak <= bound)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
        ps.destroy_model_parallel()
        _free(device)
    return rows


# --------------------------------------------------------------------------- part 3
def speed_part(args, device, dtype) -> List[dict]:
    """One ``--dense-model`` layer's dense work per format as the engine runs it (fused
    element-wise kernels), graphed: ``tools/bench_dense.py``'s rows."""
    from tknp_megatron.tools.bench_dense import format_rows, read_bandwidth

    read_b_s = read_bandwidth(device)
    rows = []
    for name in args.formats:
        for r in format_rows(args.dense_model, name, args.batches, args.reps, device, dtype, read_b_s,
                             fusion="on", seed=args.seed):
            rows.append(dict(format=name, model=args.dense_model, batch=r.batch, us=r.layer_us,
                             floor_us=r.floor_us))
            print(json.dumps(rows[-1]), flush=True)
        _free(device)
    te = {r["batch"]: r["us"] for r in rows if r["format"] == "te"}
    for r in rows:
        r["vs_te"] = r["us"] / te[r["batch"]] if r["batch"] in te else None
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    from tknp_megatron.launch import end_tool_process, init_tool_process

    device = init_tool_process(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parts = dict(tokens=tokens_part, modes=modes_part, dcp=dcp_part, memory=memory_part, speed=speed_part)
    out = {}
    for part in args.parts:
        try:
            out[part] = parts[part](args, device, dtype)
        except Exception as err:  # noqa: BLE001 - report the part's failure, run the others
            import traceback

            traceback.print_exc()
            out[part] = dict(error=f"{type(err).__name__}: {err}")
        if args.out:  # after every part: a later failure keeps what was measured
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)
    _print_tables(out)
    failed = [part for part, rows in out.items() if isinstance(rows, dict) and "error" in rows]
    if failed:  # the tables are printed; the exit status says a part failed
        print(f"check_fp8: failed: {', '.join(failed)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        if device.type == "cuda":
            os._exit(1)  # as end_tool_process: NCCL's teardown can hang
        import torch.distributed as dist

        dist.destroy_process_group()
        return 1
    return end_tool_process(device)


def _print_tables(out: dict) -> None:
    for part, rows in out.items():
        print(f"\n== {part}")
        if isinstance(rows, dict):
            print(rows["error"])
            continue
        for r in rows:
            print("  ".join(f"{k}={_short(v)}" for k, v in r.items() if k != "tokens"))


def _short(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in v.items()) + "}"
    return str(v)


if __name__ == "__main__":
    sys.exit(main())
