"""The coordinator's host work per decode step, on a CPU, without the model's compute.

A DP (or PP: one stage, its loop books a step before it plans the next) engine (one rank,
gloo) of the tiny preset with CUDA graphs on, so each step takes
the graph path (plan, padding, the rank's host inputs, booking); the executor's captured
body is replaced by a stub that returns the padded batch's tokens, as a GPU's replay would
without host work. B requests of 16-token prompts (KV ingested) decode 1,000 tokens each;
after 3 steps (admission and the first rows), 900 steady decode steps are timed one by one
(``LockstepEngine._lead``, wall clock). A profiling harness for benchmarks only.
Usage: python benchmarks/scripts/host_step_cpu.py B [prof] [pp]  (prof: cProfile's top 30; pp: the PP engine)
"""
import statistics
import sys
import time
import warnings

import torch

import parallel_state as ps
from tknp_megatron.analysis import serving as sv
from tknp_megatron.analysis.workload import fixed_length
from tknp_megatron.config import PRESETS
from tknp_megatron.engine.config import EngineConfig
from tknp_megatron.engine.factory import build_engine
from tknp_megatron.launch import init_tool_process
from tknp_megatron.mode import Mode


def main(batch: int, profile: bool, mode: Mode = Mode.DP) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    device = init_tool_process("cpu")
    preset = PRESETS["tiny"]
    config = EngineConfig(block_size=16, kv_tokens_per_node=batch * 1040, max_prefill_tokens=1 << 30,
                          cuda_graphs=True)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=1, num_pools=1)
    engine = build_engine(mode, preset, groups, config, device, torch.float32, weights=0)
    # the captured body, replayed on a GPU with no host work: the padded batch's tokens
    if mode == Mode.PP:  # (step inputs, hidden of the stage before)
        engine.executor.graph_forward = lambda inputs: torch.zeros(sum(inputs[0].key.requests_per_owner),
                                                                   dtype=torch.int64)
    else:
        engine.executor.graph_forward = lambda step: torch.zeros(sum(step.key.requests_per_owner), dtype=torch.int64)
    engine.release_trace(sv._arrivals(fixed_length(batch, 16, 1000), preset.vocab_size, 0, 0, 1))
    for _ in range(3):
        engine.step()
    if profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
    times = []
    for _ in range(900):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if profile:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    print(f"{mode.value} B={batch} host work per step: median {1e3 * statistics.median(times):.3f} ms, "
          f"min {1e3 * min(times):.3f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]), "prof" in sys.argv[2:], Mode.PP if "pp" in sys.argv[2:] else Mode.DP)
