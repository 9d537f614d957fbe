"""Builders shared by several test files: prompts, pool runs, a tiny tokenizer, tiny HF
models, and a plain Megatron-Core ``GPTModel`` saved as a distributed checkpoint.

Everything here is made in the test (no downloads); heavy imports (``tokenizers``,
``transformers``, Megatron) happen inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

__all__ = [
    "random_prompts",
    "assert_matches_reference",
    "reference_kvs",
    "spawn_runs",
    "TOKENIZER_SENTENCES",
    "make_tiny_tokenizer",
    "HF_SEQ",
    "make_hf_llama",
    "make_hf_nemotron",
    "perturb_norms",
    "save_and_run",
    "convert_and_run",
    "save_gpt_checkpoint",
    "run_main_job",
    "load_job_module",
    "lockstep_plans",
    "mixed_requests",
]


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 512) -> tuple:
    """``n`` seeded random prompts of ``lo..hi`` tokens each (ids below ``vocab``)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return tuple(tuple(torch.randint(0, vocab, (k,), generator=g).tolist()) for k in lens)


def assert_matches_reference(results, reference, logits: bool = True) -> None:
    """Each engine result completed with its reference's tokens and, with ``logits``, its
    logits within 1e-4 (fp32); log-probs, where returned, equal the reference's
    log-softmax at each token within 1e-4, and its top tokens; so do the prompt's, where
    the reference computed them."""
    for res, exp in zip(results, reference):
        assert res.status.value == "completed", res.reject_reason
        assert res.tokens == exp.tokens, f"request {res.request_id} on node {res.owner}"
        if logits:
            torch.testing.assert_close(res.logits, exp.logits, atol=1e-4, rtol=0)
        if res.log_probs is not None:
            lp = torch.log_softmax(exp.logits.float(), -1)
            want = lp.gather(1, torch.tensor(exp.tokens)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(res.log_probs), want, atol=1e-4, rtol=0)
            if res.top_log_probs is not None:
                n = len(res.top_log_probs[0])
                top = torch.topk(lp, n)
                assert [[i for i, _ in row] for row in res.top_log_probs] == top.indices.tolist()
                torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in res.top_log_probs]),
                                           top.values, atol=1e-4, rtol=0)
        if exp.prompt_logits is not None:  # the prompt's log-probs: the reference's at each next prompt token
            lp = torch.log_softmax(exp.prompt_logits.float(), -1)
            want = lp.gather(1, torch.tensor(res.prompt_tokens[1:])[:, None])[:, 0]
            assert res.prompt_log_probs is not None and len(res.prompt_log_probs) == len(res.prompt_tokens) - 1
            torch.testing.assert_close(torch.tensor(res.prompt_log_probs), want, atol=1e-4, rtol=0)
            if res.top_log_probs is not None:  # top tokens asked for: every prompt position has its own
                assert res.prompt_top_log_probs is not None and len(res.prompt_top_log_probs) == len(want)
            if res.prompt_top_log_probs:  # () for a one-token prompt
                top = torch.topk(lp, len(res.prompt_top_log_probs[0]))
                assert [[i for i, _ in row] for row in res.prompt_top_log_probs] == top.indices.tolist()
                torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in res.prompt_top_log_probs]),
                                           top.values, atol=1e-4, rtol=0)


def reference_kvs(reference: dict) -> dict:
    """Scenario name -> the reference's K/V of ``prompt[:-1]``, for the scenarios that
    ingest KV from outside (the ``reference`` fixture of ``tests/conftest.py``)."""
    return {name: kv for name, (_, kv) in reference.items() if kv is not None}


def spawn_runs(worker: Callable, args_by_world: Dict[int, tuple], timeout_s: float = 400) -> Iterator[tuple]:
    """Run ``worker`` on a fresh gloo pool per world size, in order; yield every rank's
    ``(key, run)`` results that are not ``None``."""
    from tknp_megatron.launch import spawn

    for world, args in args_by_world.items():
        for rank_out in spawn(worker, world, args, timeout_s=timeout_s):
            yield from ((key, run) for key, run in rank_out.items() if run is not None)


# ---------------------------------------------------------------- tokenizer
TOKENIZER_SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "token parallel decode spreads requests over nodes",
    "every node keeps the cache of the requests it owns",
    "megatron core builds the layers of the model",
    "a small model answers with a few tokens",
] * 4


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
"""A small chat template in the usual form (each turn between BOS and EOS)."""


def make_tiny_tokenizer(folder, vocab_size: int = 200, bos: bool = False,
                        chat_template: Optional[str] = None) -> Path:
    """Train a BPE tokenizer (Metaspace, ~``vocab_size`` ids) on :data:`TOKENIZER_SENTENCES`;
    save a HF folder (with ``chat_template`` in its config, if given).

    Special tokens ``<unk>`` (0), ``<s>`` (1), ``</s>`` (2). ``bos``: a post-processor
    puts ``<s>`` in front of every encoding, as Llama's tokenizers do.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = RawTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(TOKENIZER_SENTENCES, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
                  unk_token="<unk>", add_bos_token=bos)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        config if chat_template is None else {**config, "chat_template": chat_template}))
    return folder


# ---------------------------------------------------------------- tiny HF models
HF_SEQ = 160  # tokens of the random sequence the HF models are run on


def perturb_norms(model) -> None:
    """HF inits norms to 1 (weight) / 0 (bias): randomise so the norm mapping is tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


def save_and_run(model, folder, vocab: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Save an HF model to ``folder``; ``(ids [HF_SEQ], its fp32 logits [HF_SEQ, vocab])``."""
    model.save_pretrained(folder, safe_serialization=True)
    ids = torch.randint(0, vocab, (HF_SEQ,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()
    return ids, logits


def make_hf_llama(folder, rope_scaling: Optional[dict]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Save a random HF Llama (3 layers, GQA 4/2, vocab 256) to ``folder`` (safetensors).

    Returns:
        ``(ids [HF_SEQ], logits [HF_SEQ, 256])``: a random sequence and ``transformers``'
        fp32 CPU logits on it.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      max_position_embeddings=512, rope_theta=500000.0, rms_norm_eps=1e-5,
                      rope_scaling=rope_scaling, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    perturb_norms(model)
    return save_and_run(model, folder, 256)


def make_hf_nemotron(folder) -> Tuple[torch.Tensor, torch.Tensor]:
    """Save a random HF Nemotron (2 layers, GQA 4/2, partial RoPE 0.5, vocab 512) to
    ``folder``; returns ``(ids, logits)`` as :func:`make_hf_llama`."""
    from transformers import NemotronConfig, NemotronForCausalLM

    cfg = NemotronConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=512, max_position_embeddings=512, norm_eps=1e-5,
                         rope_theta=10000.0, partial_rotary_factor=0.5,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = NemotronForCausalLM(cfg).float().eval()
    # HF's init sets LayerNorm1P weight = 1 (gamma 2), bias 0; give the +1 and the biases
    # (final norm included) values that differ per channel.
    perturb_norms(model)
    assert {n for n, _ in model.named_parameters() if "norm" in n and n.endswith("bias")}
    return save_and_run(model, folder, 512)


def convert_and_run(rank, world, hf_dir, out_dir, ids):
    """Pool worker: convert an HF folder, load it into the reference GPTModel, and return
    ``(logits [S, vocab] on ids, preset)``."""
    warnings.simplefilter("ignore")
    import parallel_state as ps
    from tknp_megatron.executor.rope import Rope
    from tknp_megatron.models.checkpoint import load_megatron_checkpoint
    from tknp_megatron.models.hf_convert import convert_hf_to_dist_checkpoint
    from tknp_megatron.models.model_config import load_model_config
    from tknp_megatron.models.reference import build_reference_model, reference_logits

    ps.initialize_model_parallel(1)
    convert_hf_to_dist_checkpoint(hf_dir, out_dir, torch.float32)
    preset, _ = load_model_config(f"{out_dir}/model_config.json")
    model = build_reference_model(preset)  # fresh, uninitialised: everything from the ckpt
    load_megatron_checkpoint(model, out_dir)
    rope = Rope(preset, model.config, torch.device("cpu"))
    logits = reference_logits(model, rope, ids, preset.vocab_size)
    ps.destroy_model_parallel()
    return logits, preset


# ---------------------------------------------------------------- Megatron checkpoints
def save_gpt_checkpoint(preset, tp: int, ckpt_dir: str, seed: Optional[int],
                        vocab_rows: Optional[int] = None, lm_args=None, key_prefix: str = "") -> None:
    """Save a Megatron ``GPTModel`` at TP=tp with ``dist_checkpointing`` (``torch_dist``, CPU).

    Call on every rank of a ``tp``-rank pool. ``seed``: fill the weights from the seeded
    source (:func:`~tknp_megatron.models.weights.fill_seeded_`); ``None`` when the values
    do not matter (a fast random init). ``vocab_rows``: embedding rows (default Megatron's
    padding). ``lm_args``: lay the checkpoint out as Megatron-LM's training loop does (the
    state under ``"model"`` beside ``args`` and ``iteration`` in ``iter_0001000/``, and the
    tracker file naming that iteration). ``key_prefix``: the model's keys under it, as a model
    saved through a wrapper module has them (NeMo 2: ``module.``).
    """
    from megatron.core import dist_checkpointing

    import parallel_state as ps
    from tknp_megatron.models.cpu_shims import cpu_torch_dist_save_strategy
    from tknp_megatron.models.reference import build_reference_model
    from tknp_megatron.models.weights import fill_seeded_

    ps.initialize_model_parallel(tp)
    model = build_reference_model(preset, vocab_size=vocab_rows, tp=tp)
    if seed is not None:
        fill_seeded_(model, preset, seed)
    else:
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
    state = model.sharded_state_dict(key_prefix)
    if lm_args is not None:
        state = {"args": lm_args, "checkpoint_version": 3.0, "iteration": 1000, "model": state}
        Path(ckpt_dir, "latest_checkpointed_iteration.txt").write_text("1000")
        ckpt_dir = str(Path(ckpt_dir, "iter_0001000"))
        Path(ckpt_dir).mkdir(exist_ok=True)
    dist_checkpointing.save(state, ckpt_dir, sharded_strategy=cpu_torch_dist_save_strategy())
    ps.destroy_model_parallel()


# ---------------------------------------------------------------- the main job
def load_job_module(name: str = "run_tknp_decode"):
    """examples/NAME.py (the main job by default) as a module (its helper modules sit
    beside it)."""
    import importlib.util
    import sys

    job = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    if str(job.parent) not in sys.path:
        sys.path.insert(0, str(job.parent))
    spec = importlib.util.spec_from_file_location(name, job)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_main_job(*args) -> Tuple[int, str, str]:
    """``python examples/run_tknp_decode.py ARGS`` run in this process: its exit status and
    what it printed to stdout and stderr.

    Everything the job does happens as in its own process (it resolves its inputs here and
    spawns its pool, the reference beside it); what is saved is starting an interpreter and
    a forkserver, each of which imports Megatron-Core: seconds of CPU per job. The job as a
    real process, with the shell's exit status, is run by tests/test_readme.py and
    tests/test_job_inputs.py. Unless ARGS name a ``--timeout``, a pool that hangs fails
    after 300 s.
    """
    import contextlib
    import io

    argv = [str(a) for a in args] + ([] if "--timeout" in map(str, args) else ["--timeout", "300"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = load_job_module().main(argv)
    return status, out.getvalue(), err.getvalue()


def lockstep_plans(requests, nodes: int, steps: int) -> list:
    """The coordinator's loop (``LockstepEngine._lead`` without a GPU) over ``requests`` on
    ``nodes`` owners: plan step n + 1 while step n is in flight, then book step n with
    made-up tokens (100 + step + row). Per step ``(built, derived)``: the plan built request by
    request (``build_plan``) and the one derived from the step before
    (``next_decode_plan``; None where it declines), as the engine runs them."""
    from tknp_megatron.engine.scheduler import Scheduler, SchedulerConfig
    from tknp_megatron.kv_cache import BlockAllocator
    from tknp_megatron.plan import build_plan, next_decode_plan

    sched = Scheduler(SchedulerConfig(max_requests_per_node=64), [BlockAllocator(64, 16)] * nodes, lambda: 0.0)
    for r in requests:
        sched.enqueue(r)
    inflight, inflight_batch, out = None, (), []
    for n in range(steps):
        result = sched.schedule()
        if not result.batch:
            break
        built = build_plan(n, result.batch, result.admissions, nodes)
        derived = next_decode_plan(n, inflight, inflight_batch, result.batch, result.admissions)
        out.append((built, derived))
        plan = derived or built
        if inflight is not None:
            sched.postprocess(inflight, [100 + n + i for i in range(inflight.num_requests)], None, float(n))
        inflight, inflight_batch = plan, result.batch
        sched.mark_in_flight(plan)
    return out


def booked_plans(requests, microbatches: int, steps: int) -> list:
    """PP's coordinator loop (``PPInferenceEngine._lead`` without a GPU) over ``requests``
    in ``microbatches``: each tick books microbatch m's step in flight with made-up tokens
    (100 + step + row), then plans m's next step, fed from the host. Per tick that plans
    ``(built, derived)``: the plan built request by request and the one derived from m's
    plan before with the tokens just booked (None where it declines)."""
    from tknp_megatron.engine.scheduler import Scheduler, SchedulerConfig
    from tknp_megatron.kv_cache import BlockAllocator
    from tknp_megatron.plan import build_plan, next_decode_plan

    sched = Scheduler(SchedulerConfig(max_requests_per_node=64), [BlockAllocator(64, 16)], lambda: 0.0)
    for r in requests:
        sched.enqueue(r)
    awaiting, last, out, step = [None] * microbatches, [(None, ())] * microbatches, [], 0
    for tick in range(steps):
        m = tick % microbatches
        booked = None
        if awaiting[m] is not None:
            plan, awaiting[m] = awaiting[m], None
            booked = [100 + plan.step + i for i in range(plan.num_requests)]
            sched.postprocess(plan, booked, None, float(tick))
        result = sched.schedule()
        for req in result.admitted:
            req.microbatch = -1
        for req in result.admitted:
            sizes = [sum(r.microbatch == k for reqs in sched.running for r in reqs) for k in range(microbatches)]
            req.microbatch = min(range(microbatches), key=lambda k: (sizes[k], k))
        batch = [r for r in result.batch if r.microbatch == m]
        if not batch and not result.admissions:
            if not any(awaiting) and not sched.waiting and not any(sched.running):
                break
            continue
        step += 1
        built = build_plan(step, batch, result.admissions, 1)
        derived = None if booked is None else next_decode_plan(step, *last[m], batch, result.admissions, booked)
        out.append((built, derived))
        plan = derived or built
        last[m] = (plan, tuple(batch))
        awaiting[m] = plan if plan.num_requests else None
    return out


def mixed_requests() -> list:
    """Seven requests for :func:`lockstep_plans`: prompts of outside KV (one row each at
    first) and of none (whole prompts), lengths that end at different steps, greedy and
    sampled, and one that ends on its end-of-sequence id (its row in the step already
    queued is then dropped)."""
    from tknp_megatron.engine.request import Request, RequestTimeline
    from tknp_megatron.sampling import SamplingParams

    reqs = []
    for i in range(7):
        params = SamplingParams(max_new_tokens=10 + 6 * (i % 3), temperature=0.5 * (i % 2), top_k=i % 3, seed=i,
                                eos_id=112 if i == 5 else None)  # lockstep_plans' tokens: 100 + step + row
        reqs.append(Request(i, list(range(20 + i)), params, RequestTimeline(0.0), synthetic_kv=i if i % 4 else None))
    return reqs
