"""Greedy tokens of one checkpoint in several modes, against expected tokens (e.g. from
``transformers`` in fp32): how often each mode agrees, token by token.

Run under torchrun, one process per GPU; every mode is built by the engine factory over
the whole world (DP: one pool per node, requests round-robin)::

    torchrun --nproc-per-node 2 -m tknp_megatron.tools.token_agreement --load CKPT \\
        --expected expected.json --modes tknp dp pp --dtype bfloat16 --out agreement.json

``expected.json`` holds ``{"prompts": [[ids...], ...], "tokens": [[ids...], ...]}``; each
request generates as many tokens as its expected list (no end-of-sequence stop). Off GPU
(``--device cpu``, no torchrun) it starts a gloo pool itself (``--world``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Dict, List

import torch
import torch.distributed as dist

from tknp_megatron.cli import ArgumentParser
from tknp_megatron.launch import run_ranks
from tknp_megatron.mode import Mode


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--load", required=True, metavar="DIR", help="Megatron torch_dist checkpoint "
                   "(with model_config.json or Megatron-LM's stored args)")
    p.add_argument("--expected", required=True, metavar="FILE", help="prompts and expected tokens")
    p.add_argument("--modes", nargs="+", default=["tknp", "dp", "pp"], choices=[m.value for m in Mode])
    p.add_argument("--tp", type=int, default=1, help="ranks per node (TKNP, DP, PP)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--kv-tokens-per-node", type=int, default=None, help="KV budget (CPU)")
    p.add_argument("--world", type=int, default=2, help="processes when not under torchrun")
    p.add_argument("--out", default=None, metavar="FILE", help="write the rows here (JSON)")
    args = p.parse_args(argv)
    problem = expected_problem(args.expected)
    if not os.path.isdir(args.load):
        p.error(f"--load {args.load}: not a directory")
    if problem:
        p.error(f"--expected {args.expected}: {problem}")
    for flag, value in (("--tp", args.tp), ("--world", args.world)):
        if value < 1:
            p.error(f"{flag} {value}: must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device on this machine")
    return args


def expected_problem(path: str):
    """What is wrong with the ``--expected`` file (None: it holds ``prompts`` and ``tokens``,
    lists of token-id lists of the same length)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        return f"cannot read it ({err.strerror or err})"
    except ValueError as err:
        return f"not JSON ({err})"
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("prompts", "tokens")):
        return 'must be a JSON object with "prompts" and "tokens" lists'
    if len(data["prompts"]) != len(data["tokens"]):
        return f"{len(data['prompts'])} prompts but {len(data['tokens'])} token lists"
    if not all(isinstance(x, list) for x in data["prompts"] + data["tokens"]):
        return "each prompt and each token list must be a list of token ids"
    return None


def _generate(mode: Mode, args, source, prompts, lengths, device) -> Dict[int, List[int]]:
    """This pool's requests (round-robin over pools) through ``mode``; rank 0 gets all."""
    import parallel_state as ps
    from tknp_megatron.config import dtype_from_name
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import build_engine
    from tknp_megatron.sampling import SamplingParams

    pools, nodes, tp = mode.pool_shape(dist.get_world_size(), args.tp)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=tp, token_parallel_size=nodes,
                                          num_pools=pools)
    config = EngineConfig(kv_tokens_per_node=args.kv_tokens_per_node)
    engine = build_engine(mode, source.preset, groups, config, device, dtype_from_name(args.dtype),
                          weights=source.checkpoint, padded_vocab=source.padded_vocab)
    mine = [i for i in range(len(prompts)) if i % pools == groups.pool]
    params = [SamplingParams(max_new_tokens=lengths[i]) for i in mine]
    results = engine.generate([prompts[i] for i in mine], params)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {i: list(r.tokens) for i, r in zip(mine, results)})
    del engine  # its KV cache filled the GPU: free it for the next mode's
    ps.destroy_model_parallel()  # (collects the engine first)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out = {}
    for part in every:
        out.update(part)
    return out


def _agreement(got: Dict[int, List[int]], expected: List[List[int]]) -> dict:
    """Token match rate, first-token match rate and mean agreeing prefix."""
    same = total = first = prefix = 0
    for i, exp in enumerate(expected):
        toks = got[i]
        pairs = list(zip(toks, exp))
        same += sum(a == b for a, b in pairs)
        total += max(len(toks), len(exp))
        first += bool(pairs) and pairs[0][0] == pairs[0][1]
        prefix += next((k for k, (a, b) in enumerate(pairs) if a != b), len(pairs))
    n = max(1, len(expected))
    return dict(token_match_rate=same / max(1, total), first_token_match_rate=first / n,
                mean_agreeing_prefix=prefix / n)


def worker(rank: int, world: int, args):
    warnings.simplefilter("ignore")
    from tknp_megatron.models.source import resolve_source

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    data = json.loads(open(args.expected, encoding="utf-8").read())
    prompts, expected = data["prompts"], data["tokens"]
    source = resolve_source(load=args.load)
    rows = []
    for mode in map(Mode, args.modes):
        got = _generate(mode, args, source, prompts, [len(t) for t in expected], device)
        if rank == 0:
            rows.append(dict(mode=mode.value, dtype=args.dtype, requests=len(prompts),
                             tokens_per_request=[len(t) for t in expected],
                             **_agreement(got, expected), outputs=[got[i] for i in range(len(prompts))]))
            print(f"{mode.value:>6}: token match {rows[-1]['token_match_rate']:.3f}, first token "
                  f"{rows[-1]['first_token_match_rate']:.3f}, agreeing prefix "
                  f"{rows[-1]['mean_agreeing_prefix']:.1f} tokens", flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, rows = run_ranks(worker, args, args.device, args.world)
    if rank == 0 and args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f)
    sys.stdout.flush()
    if "RANK" in os.environ and args.device == "cuda":
        dist.barrier()
        os._exit(0)  # NCCL teardown can hang after the run: skip it, the rows are written
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
