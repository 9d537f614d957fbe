#!/usr/bin/env python
"""vLLM's offline engine on the serving benchmark's traces: the peer row beside Megatron's.

The engine most users would run instead of this library, on the same model geometry (the
repo's preset written as a Hugging Face ``LlamaForCausalLM`` config.json, weights from
vLLM's ``load_format="dummy"``) and the same fixed-length traces (``--contexts`` x
``--batches``, ``--output-len``; the prompts of ``analysis.workload.prompt_tokens``, given
as token ids, so no tokenizer is loaded), greedy, no early stop. One process per GPU::

    python -m tknp_megatron.tools.bench_vllm --model llama3.1-70b --layers 12 \\
        --contexts 8192 --batches 16 64 --output-len 128 --out $OUT/vllm.json

- TP: ``--tp T`` (one engine over T GPUs; vLLM starts its own worker processes).
- DP: R copies of the command, each on its own GPU (``CUDA_VISIBLE_DEVICES``), with
  ``--replicas R --replica-index i``: replica i serves requests ``i, i + R, ...``.

vLLM prefills the prompts itself (chunked prefill), while ``bench_serving`` ingests their KV
from outside, so the comparable figures are the decode ones. Each trace runs twice, prefix
caching off: ``generate`` with ``max_tokens=1`` (prefill and first token, ``t_1``) and with
``max_tokens=N`` (``t_N``) on the same prompts; then ``decode_step_ms = (t_N - t_1) / (N - 1)``
and ``decode_tok_s = B (N - 1) / (t_N - t_1)``. In the N run the requests prefilled first
decode beside the others' prefill chunks and finish first, so the last steps run smaller
batches: that figure flatters vLLM a little, and ``itl_ms_median`` (the median over requests of
vLLM's own per-request inter-token time) counts those mixed steps against it.
``--warm-decode`` adds the clean full-batch figure: prefix caching on, the cold max_tokens=1 run
on distinct prompts (so the cold N run still prefills everything), then the trace's prompts
again with N and with 1 tokens, all but each prompt's last block found in the cache, so every
request decodes from the first step (``*_warm`` fields; ``cached_tokens_min`` shows the hits,
``cold_cached_tokens_max`` that the cold runs had none). Completion throughput (``B N / t_N``)
is reported beside them, with the KV capacity vLLM allocated, its block size and the attention
backend (and FlashAttention version) its workers chose.

CUDA graphs and vLLM's torch.compile are on (vLLM's defaults) unless ``--enforce-eager``.
vLLM's FlashInfer sampler is switched off (``VLLM_USE_FLASHINFER_SAMPLER=0``): greedy
sampling never uses it, and flashinfer is not among the carried wheels
(``benchmarks/scripts/vllm_wheels.txt``). Needs vllm (written against 0.26.0) and CUDA;
each missing piece is refused in one line before anything is built. Writes JSON to
``--out``; ``--config-only DIR`` writes the config.json and stops (no vllm needed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

from tknp_megatron.cli import ArgumentParser
from tknp_megatron.tools.bench_megatron_engine import (  # the same DP split and checks
    replica_requests,
    trace_layout_problems,
)

__all__ = ["VllmRow", "hf_llama_config", "write_model_dir", "replica_requests", "decode_figures", "main"]

# vLLM settings this tool relies on; set unless the caller set them.
ENV_DEFAULTS = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",       # flashinfer is not carried; greedy never uses it
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",     # no network on the GPU machine
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # the parent may have touched CUDA
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc of _worker_probe below
    "TOKENIZERS_PARALLELISM": "false",
    "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",  # xgrammar's tvm_ffi would JIT a C++ addon at import
}


@dataclass(frozen=True)
class VllmRow:
    """One trace served by vLLM (times in seconds unless named)."""

    engine: str
    vllm_version: str
    tp: int
    replicas: int
    context: int
    batch: int
    output_len: int
    requests: int
    completed: int
    generated_tokens: int
    prefill_s: float                 # t_1: generate(max_tokens=1), prefill + first token
    makespan_s: float                # t_N: generate(max_tokens=N)
    completion_tok_s: float          # generated tokens / t_N
    decode_step_ms: Optional[float]  # (t_N - t_1) / (N - 1)
    decode_tok_s: Optional[float]    # requests (N - 1) / (t_N - t_1)
    itl_ms_median: Optional[float]   # vLLM's per-request (last - first token) / (tokens - 1)
    # --warm-decode: the same prompts again, their KV in vLLM's prefix cache (None without it)
    prefill_s_warm: Optional[float]  # generate(max_tokens=1): the last block of each prompt only
    makespan_s_warm: Optional[float]
    decode_step_ms_warm: Optional[float]  # every request decoding from the first step: full batch
    decode_tok_s_warm: Optional[float]
    itl_ms_median_warm: Optional[float]
    cached_tokens_min: Optional[int]  # fewest prompt tokens a warm request found cached
    cold_cached_tokens_max: int       # most prompt tokens a cold request found cached (should be 0)
    prefix_caching: bool
    kv_capacity_tokens: Optional[int]
    kv_fits: Optional[bool]          # every request of the trace resident at once
    block_size_tokens: Optional[int]
    attention_backend: Optional[str]
    flash_attn_version: Optional[int]
    cuda_graphs: bool
    max_num_seqs: int
    max_num_batched_tokens: Optional[int]


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3.1-70b", help="a Llama-architecture preset of tknp_megatron.config")
    p.add_argument("--layers", type=int, default=None, help="stack this many of the preset's layers")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192], help="prompt tokens per request")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64], help="requests per trace (all at t = 0)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas the trace is split over")
    p.add_argument("--replica-index", type=int, default=0)
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="per-GPU memory vLLM may use (its gpu_memory_utilization = this / total); "
                        "default: vLLM's own default utilization")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no torch.compile")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM max_num_seqs (default: the largest per-replica batch; bounds its graph sizes)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's (16384 on an H200)")
    p.add_argument("--attention-backend", default=None, help="e.g. FLASH_ATTN, TRITON_ATTN (default: vLLM's choice)")
    p.add_argument("--warm-decode", action="store_true",
                   help="prefix caching on; the cold pair runs on distinct prompts, then the trace's prompts "
                        "run again from the cache: decode at the full batch without prefill in between")
    p.add_argument("--inproc", action="store_true",
                   help="engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-only", metavar="DIR", default=None, help="write DIR/config.json and stop")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    problems = trace_layout_problems(args)
    if args.output_len < 2:
        problems.append(f"--output-len {args.output_len}: must be >= 2 (decode = the max_tokens=N run "
                        "minus the max_tokens=1 run)")
    if args.tp < 1:
        problems.append(f"--tp {args.tp}: must be >= 1")
    if args.gpu_memory_gib is not None and args.gpu_memory_gib <= 0:
        problems.append(f"--gpu-memory-gib {args.gpu_memory_gib}: must be > 0")
    per_replica = max(len(replica_requests(b, args.replicas, args.replica_index)) for b in args.batches)
    if args.max_num_seqs is not None and args.max_num_seqs < per_replica:
        problems.append(f"--max-num-seqs {args.max_num_seqs}: fewer than the {per_replica} requests of a trace")
    try:
        args.preset = _preset(args)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        p.error("; ".join(problems))
    args.max_num_seqs = args.max_num_seqs or per_replica
    return args


def _preset(args):
    """The preset, with ``--layers``; ``ValueError`` naming the flag if vLLM's Llama cannot hold it."""
    from tknp_megatron.config import Activation, get_preset

    try:
        preset = get_preset(args.model)
    except ValueError as exc:
        raise ValueError(f"--model {args.model}: {exc}") from None
    if args.layers is not None:
        from tknp_megatron.analysis.bench_traces import layers_problem

        if layers_problem(args.model, args.layers):
            raise ValueError(layers_problem(args.model, args.layers))
        preset = preset.replace(num_layers=args.layers)
    unlike = [what for what, bad in (
        ("a gated SiLU MLP", not preset.gated or preset.activation is not Activation.SILU),
        ("RMSNorm", preset.normalization != "RMSNorm" or preset.zero_centered_gamma),
        ("no biases", preset.add_bias_linear or preset.add_qkv_bias),
        ("full RoPE", preset.gpt.position_embedding_type != "rope" or preset.gpt.rotary_percent != 1.0),
    ) if bad]
    if unlike:
        raise ValueError(f"--model {args.model}: not a Llama architecture (needs {', '.join(unlike)}), "
                         "so vLLM's LlamaForCausalLM cannot serve it")
    if preset.num_attention_heads % args.tp:
        raise ValueError(f"--tp {args.tp}: must divide the {preset.num_attention_heads} attention heads "
                         f"of {args.model}")
    return preset


def hf_llama_config(preset, max_model_len: int) -> dict:
    """A Hugging Face ``LlamaForCausalLM`` config.json of ``preset`` (Llama 3.1's rope
    scaling when the preset scales RoPE, with the constants Megatron's ``_apply_scaling`` uses)."""
    gpt = preset.gpt
    llama3_vocab = gpt.vocab_size == 128256
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.ffn_hidden_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_query_groups,
        "head_dim": preset.kv_channels,
        "vocab_size": gpt.vocab_size,
        "max_position_embeddings": max(gpt.max_sequence_length, max_model_len),
        "rms_norm_eps": preset.layernorm_epsilon,
        "rope_theta": float(gpt.rotary_base),
        "rope_scaling": {"rope_type": "llama3", "factor": float(gpt.rope_scaling_factor), "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if gpt.rope_scaling else None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": gpt.share_embeddings_and_output_weights,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000 if llama3_vocab else 1,
        "eos_token_id": 128001 if llama3_vocab else 2,
        "initializer_range": preset.init_std,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "use_cache": True,
    }


def write_model_dir(preset, max_model_len: int, directory) -> Path:
    """``directory/config.json`` for vLLM (no weights: ``load_format="dummy"``; no tokenizer:
    ``skip_tokenizer_init=True``). Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_llama_config(preset, max_model_len), indent=1) + "\n")
    return directory


def decode_figures(t_1: float, t_n: float, requests: int, n: int) -> dict:
    """Decode step (ms) and decode throughput (tok/s) from the wall times of the same prompts
    generated with max_tokens 1 (``t_1``) and ``n`` (``t_n``): the ``n - 1`` tokens after the
    first cost ``t_n - t_1``. None where that difference is not positive."""
    decode_s = t_n - t_1
    if n < 2 or decode_s <= 0:
        return dict(decode_step_ms=None, decode_tok_s=None)
    return dict(decode_step_ms=decode_s / (n - 1) * 1e3, decode_tok_s=requests * (n - 1) / decode_s)


def environment_problems(tp: int) -> List[str]:
    """What this machine lacks to run vLLM, one line each (nothing is built, no CUDA context)."""
    if importlib.util.find_spec("vllm") is None:
        return ["vllm is not installed (written against vllm 0.26.0; benchmarks/scripts/vllm_wheels.txt "
                "lists the wheels it needs beside torch)"]
    import torch

    if not torch.cuda.is_available():
        return ["no CUDA device: vLLM's CUDA engine runs on GPUs only"]
    if torch.cuda.device_count() < tp:
        return [f"--tp {tp}: needs {tp} visible GPUs, {torch.cuda.device_count()} visible"]
    return []


def _worker_probe(worker) -> dict:
    """Runs inside each vLLM worker (``collective_rpc``): what its engine actually chose."""
    out = {}
    try:
        cache = worker.vllm_config.cache_config
        out.update(block_size=cache.block_size, num_gpu_blocks=cache.num_gpu_blocks,
                   model_runner=type(worker.model_runner).__module__)
        for module in worker.get_model().modules():
            backend = getattr(module, "attn_backend", None)
            if backend is not None:
                out["attention_backend"] = backend.get_name()
                out["flash_attn_version"] = getattr(getattr(module, "impl", None), "vllm_flash_attn_version", None)
                break
    except Exception as exc:  # a probe, never a reason to stop the benchmark
        out["probe_error"] = repr(exc)
    return out


def build_llm(args, model_dir: Path, max_model_len: int):
    """``vllm.LLM`` over ``model_dir`` with dummy weights; returns (llm, engine facts)."""
    import vllm
    from vllm import LLM

    kwargs = dict(model=str(model_dir), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                  tensor_parallel_size=args.tp, enable_prefix_caching=args.warm_decode, max_model_len=max_model_len,
                  max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, seed=args.seed,
                  disable_log_stats=False)  # per-request timestamps for itl_ms_median
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.attention_backend:
        kwargs["attention_config"] = {"backend": args.attention_backend}
    if args.gpu_memory_gib is not None:
        from vllm.platforms import current_platform

        total_gib = current_platform.get_device_total_memory(0) / 2**30
        kwargs["gpu_memory_utilization"] = min(1.0, args.gpu_memory_gib / total_gib)
    llm = LLM(**kwargs)
    config = llm.llm_engine.vllm_config
    facts = dict(vllm_version=vllm.__version__, block_size=config.cache_config.block_size,
                 num_gpu_blocks=config.cache_config.num_gpu_blocks,
                 max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens)
    try:
        probes = llm.collective_rpc(_worker_probe)
        facts.update({k: v for k, v in probes[0].items() if v is not None})
    except Exception as exc:
        facts["probe_error"] = repr(exc)
    return llm, facts


def _generate(llm, prompts: List[List[int]], n: int):
    """Wall time of one ``generate`` of ``prompts`` (token ids) with max_tokens ``n``, greedy, no
    EOS, no detokenization; and its outputs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    t0 = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - t0, outputs


def _itl_ms_median(outputs) -> Optional[float]:
    """Median over requests of (last - first token time) / (tokens - 1), vLLM's engine-core
    timestamps (present because the engine logs stats)."""
    itls = []
    for o in outputs:
        m = getattr(o, "metrics", None)
        n = getattr(m, "num_generation_tokens", 0) or 0
        if m is not None and n > 1 and m.last_token_ts > m.first_token_ts:
            itls.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    return statistics.median(itls) * 1e3 if itls else None


def serve_trace(llm, prompts: List[List[int]], output_len: int, cold_first: Optional[List[List[int]]] = None,
                warm: bool = False) -> dict:
    """The trace's timings (:class:`VllmRow` fields). Cold pair: ``cold_first`` (default: the
    same prompts) with max_tokens 1, then ``prompts`` with N. With ``warm`` (prefix caching on,
    ``cold_first`` distinct prompts so the cold N run prefills in full) ``prompts`` run again
    with N and with 1, every prompt found in the cache but its last block."""
    if warm and not llm.reset_prefix_cache():  # an earlier trace's prompts share ids with these
        raise RuntimeError("vLLM refused to reset its prefix cache; the cold runs would hit it")
    t_1, _ = _generate(llm, cold_first or prompts, 1)
    t_n, outputs = _generate(llm, prompts, output_len)
    generated = [len(o.outputs[0].token_ids) for o in outputs if o.outputs]
    b = len(prompts)
    row = dict(prefill_s=t_1, makespan_s=t_n, completed=sum(g == output_len for g in generated),
               generated_tokens=sum(generated), completion_tok_s=sum(generated) / t_n,
               itl_ms_median=_itl_ms_median(outputs), **decode_figures(t_1, t_n, b, output_len),
               cold_cached_tokens_max=max((o.num_cached_tokens or 0) for o in outputs),
               prefill_s_warm=None, makespan_s_warm=None, decode_step_ms_warm=None, decode_tok_s_warm=None,
               itl_ms_median_warm=None, cached_tokens_min=None)
    if warm:
        tw_n, warm_outputs = _generate(llm, prompts, output_len)
        tw_1, _ = _generate(llm, prompts, 1)
        figures = decode_figures(tw_1, tw_n, b, output_len)
        row.update(prefill_s_warm=tw_1, makespan_s_warm=tw_n, itl_ms_median_warm=_itl_ms_median(warm_outputs),
                   decode_step_ms_warm=figures["decode_step_ms"], decode_tok_s_warm=figures["decode_tok_s"],
                   cached_tokens_min=min((o.num_cached_tokens or 0) for o in warm_outputs))
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    preset = args.preset
    max_model_len = max(args.contexts) + args.output_len
    if args.config_only:
        print(write_model_dir(preset, max_model_len, args.config_only) / "config.json")
        return 0
    problems = environment_problems(args.tp)
    if problems:
        print("bench_vllm: " + "; ".join(problems), file=sys.stderr)
        return 2
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if args.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tknp_megatron.analysis import workload as wl

    model_dir = write_model_dir(preset, max_model_len, tempfile.mkdtemp(prefix="bench_vllm_"))
    t_build = time.perf_counter()
    llm, facts = build_llm(args, model_dir, max_model_len)
    kv_tokens = facts["num_gpu_blocks"] * facts["block_size"] if facts.get("num_gpu_blocks") else None
    print(f"vllm {facts['vllm_version']} built in {time.perf_counter() - t_build:.1f} s: {preset.num_layers} "
          f"layers, TP {args.tp}, KV {kv_tokens} tokens (block {facts.get('block_size')}), attention "
          f"{facts.get('attention_backend')} (FA {facts.get('flash_attn_version')}), eager {args.enforce_eager}, "
          f"probe {facts.get('probe_error', 'ok')}", flush=True)
    rows = []
    for ctx in args.contexts:
        for batch in args.batches:
            trace = wl.fixed_length(batch, ctx, args.output_len, args.seed)
            mine = replica_requests(batch, args.replicas, args.replica_index)
            prompts = [wl.prompt_tokens(trace.requests[i], preset.vocab_size, args.seed) for i in mine]
            other = [wl.prompt_tokens(trace.requests[i], preset.vocab_size, args.seed + 1) for i in mine]
            if args.warmup and not rows:  # first-call costs (JIT, allocator) out of the first row
                serve_trace(llm, [wl.prompt_tokens(trace.requests[0], preset.vocab_size, args.seed + 2)], 2)
            run = serve_trace(llm, prompts, args.output_len, other if args.warm_decode else None, args.warm_decode)
            row = VllmRow(
                engine="vllm", vllm_version=facts["vllm_version"], tp=args.tp, replicas=args.replicas,
                context=ctx, batch=batch, output_len=args.output_len, requests=len(mine), **run,
                prefix_caching=args.warm_decode, kv_capacity_tokens=kv_tokens,
                kv_fits=None if kv_tokens is None else kv_tokens >= len(mine) * (ctx + args.output_len),
                block_size_tokens=facts.get("block_size"), attention_backend=facts.get("attention_backend"),
                flash_attn_version=facts.get("flash_attn_version"), cuda_graphs=not args.enforce_eager,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=facts.get("max_num_batched_tokens"))
            rows.append(asdict(row))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        record = {k: v for k, v in vars(args).items() if k != "preset"}
        Path(args.out).write_text(json.dumps(dict(args=record, engine=facts, rows=rows), indent=1))
    try:  # stop vLLM's engine-core and worker processes before this one exits
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:
        print(f"bench_vllm: engine shutdown: {exc!r}", file=sys.stderr)
    return 0


def cli() -> None:
    """Console entry point: :func:`main`, then exit at once (:func:`~tknp_megatron.launch.exit_with`)."""
    from tknp_megatron.launch import exit_with

    exit_with(main)


if __name__ == "__main__":
    cli()
