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
   (measured), and the KV capacity in tokens.
3. Speed. One ``--dense-model`` layer's dense work (fused norm + QKV, attention output
   projection, residual, norm + MLP; attention excluded) at each ``--batches``, captured in
   a CUDA graph, per format: microseconds and the ratio to ``te``.

``--device cpu`` runs part 1 with ``--formats local`` only (a smoke test of this script:
Transformer Engine needs a GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import warnings
from typing import Dict, List

import torch
import torch.distributed as dist

from tknp_megatron.models.precision import DenseFormat

FORMATS: Dict[str, DenseFormat] = {
    "local": DenseFormat("local"),
    "te": DenseFormat("transformer_engine"),
    "fp8": DenseFormat("transformer_engine", "tensorwise"),
    "fp8-blockwise": DenseFormat("transformer_engine", "blockwise"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity-model", default="llama3.1-70b")
    p.add_argument("--capacity-layers", type=int, default=12)
    p.add_argument("--gpu-memory-cap-gib", type=float, default=34.6)
    p.add_argument("--dense-model", default="llama3.1-70b")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--parts", nargs="+", default=["tokens", "memory", "speed"],
                   choices=("tokens", "memory", "speed"))
    p.add_argument("--out", default=None, metavar="FILE")
    args = p.parse_args(argv)
    if args.device == "cpu":
        args.formats, args.parts = ["local"], ["tokens"]
    return args


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- part 1
def _engine_tokens(preset, groups, fmt, device, dtype, args, prompts, cuda_graphs=False):
    """``(tokens per request, [R, vocab] first-token logits or None)`` of a TKNP engine."""
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine
    from tknp_megatron.sampling import SamplingParams

    kv = None if device.type == "cuda" else args.requests * (args.prompt_len + args.output_len)
    config = EngineConfig(kv_tokens_per_node=kv, gpu_memory_cap_gib=args.gpu_memory_cap_gib,
                          record_logits=not cuda_graphs, cuda_graphs=cuda_graphs)
    engine = build_engine(Mode.TKNP, preset, groups, config, device, dtype, weights=args.seed,
                          dense=fmt)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=args.output_len))
    tokens = [list(r.tokens) for r in results]
    first = None if cuda_graphs else torch.stack([r.logits[0] for r in results]).float().cpu()
    del engine, results
    _free(device)
    return tokens, first


def _megatron_first_logits(preset, fmt, device, dtype, args, prompts) -> torch.Tensor:
    """``[R, vocab]``: Megatron's own GPTModel (this format's spec and weights), the last
    prompt position's logits, all prompts in one forward."""
    from megatron.core import parallel_state as mpu

    from tknp_megatron.engine.factory import load_weights
    from tknp_megatron.executor.rope import Rope
    from tknp_megatron.models.reference import build_reference_model, reference_to_fp8

    mpu.initialize_model_parallel(1)
    model = build_reference_model(preset, dtype, device, dense=fmt)
    load_weights(model, preset, args.seed)
    if fmt.fp8:
        model = reference_to_fp8(model, preset)
    with torch.no_grad():
        ids = torch.tensor(prompts, device=device)  # [R, S]
        hidden = model.embedding(ids, position_ids=None)  # [S, R, h]
        freqs = Rope(preset, model.config, device).freqs(torch.arange(ids.shape[1], device=device))
        hidden = model.decoder(hidden, attention_mask=None, rotary_pos_emb=freqs)
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(hidden[-1:], weight=weight)  # [1, R, V]
    out = logits[0, :, : preset.vocab_size].float().cpu()
    del model, hidden, logits
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
    from tknp_megatron.config import get_preset

    preset = get_preset(args.model).replace(num_layers=args.layers)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, preset.vocab_size, (args.requests, args.prompt_len), generator=gen).tolist()
    rows, base = [], None
    for name in args.formats:
        fmt = FORMATS[name]
        groups = ps.initialize_model_parallel(tensor_model_parallel_size=1)
        tokens, first = _engine_tokens(preset, groups, fmt, device, dtype, args, prompts)
        graphed = None
        if fmt.fp8:
            graphed, _ = _engine_tokens(preset, groups, fmt, device, dtype, args, prompts, cuda_graphs=True)
        ps.destroy_model_parallel()
        row = dict(format=name, dense=fmt.resolved(device).describe())
        ref = _megatron_first_logits(preset, fmt, device, dtype, args, prompts)  # same format
        row.update(megatron_first_token_agreement=float((ref.argmax(-1) == first.argmax(-1)).float().mean()),
                   megatron_first_logit_max_diff=float((ref - first).abs().max()))
        if graphed is not None:
            row["graphs_vs_eager"] = _agreement(graphed, tokens)["token_agreement"]
        if base is None:
            base = (tokens, first)
        else:
            diff = (first - base[1]).abs()
            row.update(vs_local=_agreement(tokens, base[0]),
                       vs_local_first_logit_max_diff=float(diff.max()),
                       vs_local_first_logit_mean_diff=float(diff.mean()))
        row["tokens"] = tokens
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    return rows


# --------------------------------------------------------------------------- part 2
def memory_part(args, device, dtype) -> List[dict]:
    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine, placement_for

    preset = get_preset(args.capacity_model).replace(num_layers=args.capacity_layers)
    rows = []
    for name in args.formats:
        fmt = FORMATS[name]
        groups = ps.initialize_model_parallel(tensor_model_parallel_size=1)
        predicted = placement_for(Mode.TKNP, preset, groups, fmt.resolved(device)).node_bytes[0]
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
                   kv_capacity_tokens=engine.kv_capacity_tokens[0])
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
        ps.destroy_model_parallel()
        _free(device)
    return rows


# --------------------------------------------------------------------------- part 3
def speed_part(args, device, dtype) -> List[dict]:
    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.factory import load_weights
    from tknp_megatron.executor.dense import finish_layer, qkv_projection
    from tknp_megatron.models.model import build_stage_model
    from tknp_megatron.models.precision import dense_autocast, store_fp8_weights_

    preset = get_preset(args.dense_model).replace(num_layers=1)
    rows = []
    for name in args.formats:
        fmt = FORMATS[name]
        groups = ps.initialize_model_parallel(tensor_model_parallel_size=1)
        model = build_stage_model(preset, [0], pre_process=False, post_process=False, tp=1,
                                  params_dtype=dtype, device=device, dense=fmt)
        load_weights(model, preset, args.seed)
        if fmt.fp8:
            store_fp8_weights_(model)
        block = model.layer(0)
        for b in args.batches:
            hidden = torch.randn(b, 1, preset.hidden_size, device=device, dtype=dtype)
            attn = torch.randn(b, 1, preset.num_attention_heads * preset.kv_channels, device=device, dtype=dtype)

            def step():
                qkv_projection(block, hidden)
                return finish_layer(block, attn, hidden)

            with torch.no_grad(), dense_autocast(model.config, groups.tp_group):
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        step()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
            times = []
            for _ in range(args.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            rows.append(dict(format=name, model=args.dense_model, batch=b, us=statistics.median(times)))
            print(json.dumps(rows[-1]), flush=True)
            del graph
        del model, block
        ps.destroy_model_parallel()
        _free(device)
    te = {r["batch"]: r["us"] for r in rows if r["format"] == "te"}
    for r in rows:
        r["vs_te"] = r["us"] / te[r["batch"]] if r["batch"] in te else None
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    if "RANK" not in os.environ:  # one process without torchrun
        from tknp_megatron.launch import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parts = dict(tokens=tokens_part, memory=memory_part, speed=speed_part)
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
    sys.stdout.flush()
    if device.type == "cuda":
        os._exit(0)  # NCCL teardown can hang: the results are written
    dist.destroy_process_group()
    return 0


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
