"""Megatron-Core's own inference server in front of TKNP pools, over real HTTP.

One server (``examples/serve_tknp.py``: two pools of 2 nodes x TP1 behind Megatron's
coordinator and its HTTP front end in two processes, gloo on CPU, the ``tiny`` preset, Megatron's null
tokenizer) is queried with the ``openai`` client, plain HTTP and Megatron's own
``InferenceClient``; its answers are checked against the engine's offline ``generate`` on
the same weights and against the reference model's log-softmax. A second server is
broken on purpose (a rank killed mid-decode).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import torch

from tknp_megatron.launch import spawn

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "examples" / "serve_tknp.py"
EOD = 511  # Megatron's null tokenizer over the tiny preset's 512 ids
KV_PER_NODE = 128  # 4 nodes x 4 requests of 2 blocks: a quarter of the 64-request load
MAX_TOKENS = 8
ECHOED = 4  # requests also sent with echo (their prompts' log-probs too)
START_TIMEOUT_S = 180


class Server:
    """``serve_tknp.py`` in a subprocess: its ready line, its stdout, its process tree."""

    def __init__(self, *flags: str, make: bool = False):
        from tknp_megatron.launch import free_port

        self.port = free_port()
        self.stderr = tempfile.NamedTemporaryFile("w+", prefix="serve_tknp-", suffix=".log")
        flags = ("--port", str(self.port), *flags)
        argv = ["make", "serve", "ARGS=" + " ".join(flags)] if make else [sys.executable, str(SERVE), *flags]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.stderr, text=True, cwd=ROOT)
        self.lines: list = []
        self.tree = [self.proc.pid]
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log()
                self.kill()
                raise AssertionError(f"server not ready (exit code {self.proc.returncode}): "
                                     f"{self.lines}\n{log}")
        line = next(x for x in self.lines if " ready " in x)
        self.info = json.loads(line.split(" ready ", 1)[1])
        self.url = self.info["url"]

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if " ready " in line:
                self.tree += [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
                self._ready.set()

    def log(self, chars: int = 4000) -> str:
        """The tail of the server's stderr."""
        self.stderr.flush()
        return Path(self.stderr.name).read_text(errors="replace")[-chars:]

    def alive(self) -> list:
        return [p for p in self.tree if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]

    def left_after(self, seconds: float) -> list:
        """The processes of the server's tree still alive ``seconds`` from now, or sooner
        once none is."""
        deadline = time.monotonic() + seconds
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.alive()

    def kill(self):
        with contextlib.suppress(psutil.Error):
            self.tree += [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        for p in self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        self.proc.wait(10)
        self.stderr.close()


@pytest.fixture(scope="module")
def server():
    # two HTTP processes on the port (Megatron 0.17+ starts four by default), so every test
    # of this server also goes through replicas sharing the load
    s = Server("--pools", "2", "--nodes", "2", "--tp", "1", "--kv-tokens-per-node", str(KV_PER_NODE),
               "--idle-tick", "0.5", "--frontend-replicas", "2")
    assert len(s.info["frontend_pids"]) == 2
    yield s
    if s.proc.poll() is None:
        s.kill()


def _prompts(n: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(9, 17, (n,), generator=gen).tolist()  # + 8 new tokens: 2 blocks each
    return [torch.randint(0, EOD, (k,), generator=gen).tolist() for k in lens]


def _ids(text: str) -> list:
    return [int(t) for t in text.split()]


def _tokens(choice: dict) -> list:
    """A completion's generated ids: megatron-core 0.17+ returns them; 0.16 only the text
    (the null tokenizer's text is the ids; 0.17+ drops a trailing end token from it)."""
    ids = choice.get("generation_token_ids")
    return list(ids) if ids is not None else _ids(choice["text"])


def offline_worker(rank, world, prompts, sequences):
    """The engine's own ``generate`` on a 2 x TP1 pool (same weights, budget and end
    token), then on rank 0 the reference model's log-softmax along ``sequences``
    (``(prompt_len, ids)``: the log-prob of every token after the prompt)."""
    from megatron.core import parallel_state as mpu

    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine, load_weights
    from tknp_megatron.executor.rope import Rope
    from tknp_megatron.models.reference import build_reference_model, reference_logits
    from tknp_megatron.sampling import SamplingParams

    preset = get_preset("tiny")
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=2)
    engine = build_engine(Mode.TKNP, preset, groups, EngineConfig(kv_tokens_per_node=KV_PER_NODE),
                          torch.device("cpu"), torch.float32, weights=0)
    params = SamplingParams(max_new_tokens=MAX_TOKENS, eos_id=EOD)
    results = engine.generate(prompts, params)
    ps.destroy_model_parallel()
    mpu.initialize_model_parallel(1)
    ref = None
    if rank == 0:
        model = build_reference_model(preset)
        load_weights(model, preset, 0)
        rope = Rope(preset, model.config, torch.device("cpu"))
        ref = []
        for prompt_len, ids in sequences:
            lp = torch.log_softmax(reference_logits(model, rope, torch.tensor(ids), preset.vocab_size), -1)
            rows = lp[prompt_len - 1: len(ids) - 1]
            ref.append((rows.gather(1, torch.tensor(ids[prompt_len:])[:, None])[:, 0], rows))
    mpu.destroy_model_parallel()
    return [r.tokens for r in results], ref


@pytest.fixture(scope="module")
def served(server):
    """64 concurrent greedy requests over HTTP (log-probs with the top 2), and the offline
    run of the same prompts with the reference log-probs of what was served."""
    prompts = _prompts(64, seed=1)

    def ask(p):
        body = dict(prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
        return requests.post(server.url + "/v1/completions", json=body, timeout=300)

    with ThreadPoolExecutor(64) as pool:
        replies = list(pool.map(ask, prompts))
    assert [r.status_code for r in replies] == [200] * 64, [r.text for r in replies if r.status_code != 200]
    choices = [r.json()["choices"][0] for r in replies]
    tokens = [_tokens(c) for c in choices]
    # echo with logprobs, as lm-eval's log-likelihood requests ask: the prompt's log-probs too
    echoed = [requests.post(server.url + "/v1/completions", timeout=300, json=dict(
        prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=2, echo=True)) for p in prompts[:ECHOED]]
    assert [r.status_code for r in echoed] == [200] * ECHOED, [r.text for r in echoed]
    sequences = [(len(p), p + t) for p, t in zip(prompts, tokens)]
    sequences += [(1, p + t) for p, t in zip(prompts[:ECHOED], tokens)]  # every token's after the first
    offline, ref = spawn(offline_worker, 2, (prompts, sequences), timeout_s=300)[0]
    return dict(prompts=prompts, choices=choices, tokens=tokens, offline=offline, ref=ref[:len(prompts)],
                echoed=[r.json()["choices"][0] for r in echoed], echoed_ref=ref[len(prompts):])


def test_64_concurrent_requests_over_a_quarter_budget_equal_the_offline_run(server, served):
    blocks_per_request = 2  # prompts of 9-16 tokens + 8 new ones, 16-token blocks
    held = sum(server.info["kv_tokens_per_node"]) * server.info["pools"] // (16 * blocks_per_request)
    assert held == 64 // 4
    assert all(served["tokens"]), "every request generated tokens"
    assert [tuple(t) for t in served["tokens"]] == [tuple(t) for t in served["offline"]]


def test_log_probs_equal_the_reference_log_softmax(served):
    for choice, (lp, rows) in zip(served["choices"], served["ref"]):
        got = choice["logprobs"]["token_logprobs"][1:]  # Megatron puts None first
        assert torch.allclose(torch.tensor(got), lp, atol=1e-4, rtol=0)
        for top, row in zip(choice["logprobs"]["top_logprobs"][1:], rows):
            want = torch.topk(row, 2)
            assert sorted(_ids(" ".join(top))) == sorted(want.indices.tolist())
            assert torch.allclose(torch.tensor(sorted(top.values(), reverse=True)), want.values, atol=1e-4)


def test_echo_with_logprobs_returns_the_prompts_log_probs_too(served):
    """``echo`` with ``logprobs`` (what lm-eval's log-likelihood requests send): every token's
    log-prob after the first, the prompt's from its prefill in the pool, equal to the
    reference's log-softmax, with each position's top 2."""
    for choice, (lp, rows), prompt, tokens in zip(served["echoed"], served["echoed_ref"], served["prompts"],
                                                  served["tokens"]):
        got = choice["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(prompt) + len(tokens)
        assert torch.allclose(torch.tensor(got[1:]), lp, atol=1e-4, rtol=0)
        tops = choice["logprobs"]["top_logprobs"]
        assert tops[0] is None and len(tops) == len(got)
        for top, row in zip(tops[1:], rows):
            want = torch.topk(row, 2)
            assert sorted(_ids(" ".join(top))) == sorted(want.indices.tolist())
            assert torch.allclose(torch.tensor(sorted(top.values(), reverse=True)), want.values, atol=1e-4)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, served):
    """OpenAI's way to score a text: ``echo``, ``logprobs`` and ``max_tokens`` 0; without
    ``echo`` and ``logprobs``, ``max_tokens`` 0 is still a 400."""
    for prompt, (lp, _) in zip(served["prompts"][:ECHOED], served["echoed_ref"]):
        reply = requests.post(server.url + "/v1/completions", timeout=120, json=dict(
            prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True))
        assert reply.status_code == 200, reply.text
        got = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(prompt)
        assert torch.allclose(torch.tensor(got[1:]), lp[: len(prompt) - 1], atol=1e-4, rtol=0)
    assert requests.post(server.url + "/v1/completions", timeout=120, json=dict(
        prompt=served["prompts"][0], max_tokens=0, logprobs=1)).status_code == 400


def _put_api(server, **body):
    return requests.put(server.url + "/api", json=body, timeout=120)


def test_megatrons_legacy_put_api_gives_the_offline_tokens_and_every_log_prob(server, served):
    """``PUT /api`` as Megatron-LM's ``tools/text_generation_cli.py`` sends it (``top_k`` 1:
    greedy): each prompt followed by the offline run's tokens; with ``logprobs`` every
    token's log-prob after the first, the prompt's included; ``tokens_to_generate`` 0 scores
    the prompt alone."""
    prompts = served["prompts"][:ECHOED]
    texts = [" ".join(map(str, p)) for p in prompts]
    reply = _put_api(server, prompts=texts, tokens_to_generate=MAX_TOKENS, top_k=1)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["tokens"] == [p + list(t) for p, t in zip(prompts, served["offline"])]
    assert out["text"] == [" ".join(map(str, t)) for t in out["tokens"]]
    assert out["segments"] == [[str(t) for t in toks] for toks in out["tokens"]] and "logprobs" not in out
    scored = _put_api(server, prompts=texts, tokens_to_generate=MAX_TOKENS, top_k=1, logprobs=True).json()
    for lps, (lp, _), prompt, tokens in zip(scored["logprobs"], served["echoed_ref"], prompts, served["tokens"]):
        assert len(lps) == len(prompt) - 1 + len(tokens)
        assert torch.allclose(torch.tensor(lps), lp, atol=1e-4, rtol=0)
    alone = _put_api(server, prompts=texts, tokens_to_generate=0, logprobs=True).json()
    assert alone["tokens"] == prompts
    for lps, (lp, _), prompt in zip(alone["logprobs"], served["echoed_ref"], prompts):
        assert torch.allclose(torch.tensor(lps), lp[: len(prompt) - 1], atol=1e-4, rtol=0)


def test_the_legacy_api_seeds_its_draws_and_refuses_as_megatron_does(server, served):
    text = " ".join(map(str, served["prompts"][0]))
    draws = [_put_api(server, prompts=[text], tokens_to_generate=6, random_seed=11).json()["tokens"]
             for _ in range(2)]
    assert draws[0] == draws[1]
    for body, message in [
        (dict(tokens_to_generate=4), "prompts argument required"),
        (dict(prompts=text), "prompts is not a list of strings"),
        (dict(prompts=[text], top_k=5, top_p=0.5), "cannot set both top-k and top-p samplings."),
        (dict(prompts=[text], temperature=0), "temperature must be a positive number"),
        (dict(prompts=[text], tokens_to_generate=0), "tokens_to_generate=0 implies logprobs should be True"),
        (dict(prompts=[text], stop_on_eol=True), "stop_on_eol True: not acted on by Megatron's engine path"),
        (dict(prompts=["1 2 x"]), "prompts:"),
        (dict(prompts=[text] * 129), "Maximum number of prompts is 128"),
        (dict(prompts=[text, "1 600"]), "token id 600 outside the vocabulary [0, 512)"),  # the pool refuses it
    ]:
        reply = _put_api(server, **body)
        assert reply.status_code == 400 and message in reply.json()["message"], (body, reply.text)
    assert _put_api(server, prompts=[text], tokens_to_generate=2, top_k=1).status_code == 200


def test_openai_client_greedy_completion_equals_the_offline_tokens(server, served):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)
    for i in (0, 1, 2):
        text = " ".join(map(str, served["prompts"][i]))
        out = client.completions.create(model="tiny", prompt=text, max_tokens=MAX_TOKENS, temperature=0)
        assert _ids(out.choices[0].text) == list(served["offline"][i])


def test_max_tokens_and_health_over_plain_http(server, served):
    assert requests.get(server.url + "/health", timeout=30).json()["ready"] is True
    for n in (1, 3):
        body = dict(prompt=served["prompts"][5], max_tokens=n, temperature=0)
        r = requests.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and _tokens(r.json()["choices"][0]) == list(served["offline"][5][:n])


def _with_megatron_client(server, use):
    """``await use(client)`` with Megatron's own ``InferenceClient`` connected to the
    server's coordinator (ZMQ), started and stopped as the installed version needs."""
    from megatron.core.inference.inference_client import InferenceClient

    async def go():
        client = InferenceClient(server.info["coordinator"])
        started = client.start()
        if inspect.isawaitable(started):  # async in 0.16
            await started
        try:
            return await use(client)
        finally:
            client.stop()

    return asyncio.run(go())


async def _pause(client) -> None:
    paused = client.pause_engines()
    if inspect.isawaitable(paused):  # 0.16 waits for every pool's PAUSE_ACK
        await asyncio.wait_for(paused, 60)
    await asyncio.sleep(0.5)


def _as_dict(reply) -> dict:
    """An ended request as a dict (0.16 replies with a record object, 0.17 and later with
    the serialized request)."""
    if isinstance(reply, dict):
        return reply
    request = reply.requests[-1]
    return dict(status=request.status.name, generated_tokens=request.generated_tokens,
                generated_text=request.generated_text, generated_log_probs=request.generated_log_probs)


def test_stop_words_end_a_request_where_megatrons_engine_would(server, served):
    from megatron.core.inference.sampling_params import SamplingParams

    full = list(served["offline"][7])
    word = full[2]  # the first occurrence of this token ends the request
    kept = "detokenize_stop_sequence" not in SamplingParams.__dataclass_fields__  # 0.16 keeps it
    cut = full[: full.index(word) + kept]
    params = SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=MAX_TOKENS,
                            stop_words=[str(word)], return_log_probs=True, skip_prompt_log_probs=True)
    record = _as_dict(_with_megatron_client(server, lambda client: asyncio.wait_for(
        client.add_request(served["prompts"][7], params), 120)))
    assert record["status"] == "COMPLETED"
    assert list(record["generated_tokens"]) == cut
    assert _ids(record["generated_text"]) == cut
    assert len(record["generated_log_probs"] or []) == len(cut)


def test_a_bodys_stop_ends_a_completion_as_megatrons_later_endpoints_pass_it_on(server, served):
    """``stop`` in a ``/v1/completions`` body: megatron-core 0.17 and later pass it to their
    engine as ``stop_words``; on 0.16, whose endpoint drops it, the front end does."""
    from megatron.core.inference.sampling_params import SamplingParams

    full = list(served["offline"][6])
    word = full[2]
    kept = "detokenize_stop_sequence" not in SamplingParams.__dataclass_fields__  # 0.16 keeps it
    for stop in (str(word), [str(EOD), str(word)]):
        r = requests.post(server.url + "/v1/completions", timeout=120, json=dict(
            prompt=served["prompts"][6], max_tokens=MAX_TOKENS, temperature=0, stop=stop))
        assert r.status_code == 200, r.text
        assert _tokens(r.json()["choices"][0]) == full[: full.index(word) + kept]


def test_a_seeded_request_draws_what_it_drew_before(server, served):
    """``seed`` in the body (which Megatron's endpoints drop) keys the draws' noise with the
    choice's index instead of the request's id: the same seeded request sampled at
    temperature 1 gives the same tokens each time, on either pool; another seed, or none,
    other tokens."""
    def ask(**fields):
        r = requests.post(server.url + "/v1/completions", timeout=120, json=dict(
            prompt=served["prompts"][9], max_tokens=MAX_TOKENS, temperature=1.0, **fields))
        assert r.status_code == 200, r.text
        return _tokens(r.json()["choices"][0])

    first = [ask(seed=1234) for _ in range(4)]  # spread over both pools
    assert all(t == first[0] for t in first), first
    assert ask(seed=1235) != first[0] and [ask() for _ in range(2)] != [first[0]] * 2


def test_a_temperature_below_greedy_below_draws_the_greedy_tokens(server, served):
    """A temperature near float32's smallest normal would scale the logits to infinity, where
    the draw's argmax takes the first infinite logit; below ``GREEDY_BELOW`` it is greedy."""
    for temperature in (1e-40, 1e-30, 5e-6):
        r = requests.post(server.url + "/v1/completions", timeout=120, json=dict(
            prompt=served["prompts"][4], max_tokens=MAX_TOKENS, temperature=temperature))
        assert r.status_code == 200 and _tokens(r.json()["choices"][0]) == list(served["offline"][4]), (
            temperature, r.text)


def test_health_answers_at_once_while_many_requests_are_held_open(server, served):
    """With the pools paused, 48 HTTP requests stay open; ``/health`` still answers at once,
    and after UNPAUSE every request gets its offline tokens. Each open request holds a worker
    thread of megatron-core 0.16's Flask app until its reply, so asyncio's default pool of
    min(32, CPUs + 4) threads would hold /health behind them until the pools resumed."""
    n = 48

    def ask(i):
        return requests.post(server.url + "/v1/completions", timeout=300, json=dict(
            prompt=served["prompts"][i], max_tokens=MAX_TOKENS, temperature=0))

    async def use(client):
        await _pause(client)
        with ThreadPoolExecutor(n) as pool:
            replies = [pool.submit(ask, i) for i in range(n)]
            await asyncio.sleep(2.0)
            start = time.perf_counter()
            try:
                health = await asyncio.to_thread(requests.get, server.url + "/health", timeout=10)
            finally:
                waited, still_open = time.perf_counter() - start, sum(not r.done() for r in replies)
                client.unpause_engines()
            return health, waited, still_open, [r.result() for r in replies]

    health, waited, still_open, replies = _with_megatron_client(server, use)
    assert health.status_code == 200 and waited < 2.0 and still_open == n, (health, waited, still_open)
    assert [_tokens(r.json()["choices"][0]) for r in replies] == [list(t) for t in served["offline"][:n]]


def test_values_megatrons_client_sends_unchecked_fail_that_request_only(server, served):
    """Megatron's ``InferenceClient`` sends its ``SamplingParams`` as they are: a top-k beyond
    64 bits, or a stop word that is not text, ends that request FAILED; the pool serves on."""
    from megatron.core.inference.sampling_params import SamplingParams

    bad = [SamplingParams(temperature=1.0, top_k=2**63, num_tokens_to_generate=4),
           SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=4, stop_words=[5])]
    good = SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=MAX_TOKENS, termination_id=EOD)

    async def use(client):
        replies = [await asyncio.wait_for(client.add_request(served["prompts"][0], p), 60) for p in bad]
        return replies, await asyncio.wait_for(client.add_request(served["prompts"][5], good), 120)

    replies, after = _with_megatron_client(server, use)
    assert [_as_dict(r)["status"] for r in replies] == ["FAILED", "FAILED"]
    assert list(_as_dict(after)["generated_tokens"]) == list(served["offline"][5])


def test_pause_holds_requests_until_unpause(server, served):
    """Megatron's PAUSE (through its coordinator, to both pools): a request submitted while
    paused waits; after UNPAUSE it completes with the offline tokens."""
    from megatron.core.inference.sampling_params import SamplingParams

    async def use(client):
        await _pause(client)
        future = client.add_request(served["prompts"][3], SamplingParams(
            temperature=1.0, top_k=1, num_tokens_to_generate=MAX_TOKENS, termination_id=EOD))
        await asyncio.sleep(2.0)
        waited = not future.done()
        client.unpause_engines()
        return waited, await asyncio.wait_for(future, 60)

    waited, reply = _with_megatron_client(server, use)
    assert waited, "a request submitted while paused was served"
    assert list(_as_dict(reply)["generated_tokens"]) == list(served["offline"][3])


@pytest.mark.parametrize("body, messages", [
    (dict(prompt="", max_tokens=4), ("prompt' is empty", "Missing 'prompt' field")),
    (dict(prompt="1 2 600", max_tokens=4), ("token id 600 outside the vocabulary [0, 512)",)),
    (dict(prompt="1 2 3", max_tokens=0), ("'max_tokens' 0: must be at least 1",)),
    (dict(prompt="1 2 3", max_tokens=[4]), ("'max_tokens' [4]: expected a number, got list",)),
    (dict(prompt="1 2 3", max_tokens=4, n=0), ("'n' 0: must be in [1, 128]",)),
    (dict(prompt="1 2 3", max_tokens=4, n=10**7), ("'n' 10000000: must be in [1, 128]",)),
    (dict(prompt=" ".join(["7"] * 1100), max_tokens=4), ("exceeds max_sequence_length 1024",)),
    (dict(prompt="1 2 3", max_tokens=4, temperature=-1), ("'temperature' -1: must be finite and >= 0",)),
    ("{not json", ("not a JSON object", "Invalid or missing JSON body")),
    (dict(prompt="1 2 3", max_tokens=4, temperature=0, logprobs=513),
     ("'logprobs' 513: must be in [0, the vocabulary 512]",)),
    (dict(prompt="1 9223372036854775808", max_tokens=4),
     ("token id 9223372036854775808 outside the vocabulary [0, 512)",)),
    (dict(prompt="1 2 3", max_tokens=4, temperature=1, top_k=2**63),
     ("'top_k' 9223372036854775808: outside the 64-bit integer range",)),
    (dict(prompt="1 2 3", max_tokens=1e20), ("'max_tokens' 1e+20: outside the 64-bit integer range",)),
    (dict(prompt=5, max_tokens=4), ("'prompt' 5: expected text or a list, got int",)),
    (dict(prompt="1 2 3", max_tokens=None), ("'max_tokens' is null",)),
    (dict(prompt="1 2 3 ", max_tokens=4), ("'prompt' '1 2 3 ': '' is not a token id; Megatron's null tokenizer",)),
    (dict(prompt="1 18446744073709551616", max_tokens=4), ("token id 18446744073709551616 outside the vocabulary",)),
    (dict(prompt="1 2", max_tokens=10**400), ("'max_tokens' 100000000000... (401 digits): outside the 64-bit",)),
    (dict(prompt="1 2", max_tokens=4, temperature=-10**400), ("'temperature' -10000000000... (402 digits): must be",)),
    ('{"prompt": "1 \\ud800", "max_tokens": 4}', ("'prompt': not valid Unicode",)),
    (dict(prompt="1 2", max_tokens=4, n=2), ("'n' 2: Megatron's completions endpoint gives one choice per prompt",)),
    (dict(prompt="1 2", max_tokens=4, stream=True), ("'stream' true: this megatron-core's endpoints answer in one",)),
    (dict(prompt="1 2", max_tokens=4, stop=[3]), ("'stop' [3]: expected text or a list of texts",)),
], ids=["empty", "vocab", "max_tokens_0", "max_tokens_list", "n_0", "n_huge", "too_long", "negative_temperature", "malformed_json", "logprobs_vocab",
        "id_64_bits", "top_k_64_bits", "max_tokens_64_bits", "prompt_int", "max_tokens_null", "null_tokenizer_text",
        "text_id_64_bits", "max_tokens_digits", "temperature_digits", "lone_surrogate", "n_completions", "stream", "stop_ids"])
def test_bad_input_is_answered_with_the_problem_and_the_server_keeps_serving(server, served, body, messages):
    """400 and the problem in the body, both for what the body shows (the front end's check)
    and for what the pool refuses (a text prompt's ids outside the vocabulary or beyond the
    sequence limit: a non-transient failure, which megatron-core 0.17 and later answer 400
    themselves and 0.16's endpoint would answer 500). The message is ours, or Megatron's
    own for the two its endpoint checks itself."""
    if isinstance(body, str):
        r = requests.post(server.url + "/v1/completions", data=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    else:
        r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and any(m in r.text for m in messages), (r.status_code, r.text)
    good = requests.post(server.url + "/v1/completions", timeout=120,
                         json=dict(prompt=served["prompts"][0], max_tokens=MAX_TOKENS, temperature=0))
    assert _tokens(good.json()["choices"][0]) == list(served["offline"][0])


def test_the_readme_curl_and_openai_examples(server):
    from tests.test_readme import fenced_blocks

    here = server.url.split("//")[1]
    (curl,) = ["\n".join(b) for b in fenced_blocks("bash") if b[0].startswith("curl ")]
    proc = subprocess.run(curl.replace("127.0.0.1:5000", here), shell=True, capture_output=True,
                          text=True, timeout=120)
    reply = json.loads(proc.stdout)["choices"][0]
    (snippet,) = ["\n".join(b) for b in fenced_blocks("python") if "OpenAI(" in "\n".join(b)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(snippet.replace("127.0.0.1:5000", here), {})
    assert _ids(out.getvalue()) == _ids(reply["text"]) and len(_ids(reply["text"])) >= 1
    assert len(reply["logprobs"]["token_logprobs"]) == len(_ids(reply["text"])) + 1


def test_orderly_stop_both_pools_served_and_nothing_is_left(server, served):
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    assert time.monotonic() - start < 60
    assert server.left_after(10) == []
    ended = [line for line in server.lines if " ended " in line]
    completed = {int(line.split("pool ")[1].split()[0]): int(line.split("): ")[1].split()[0]) for line in ended}
    assert sorted(completed) == [0, 1] and min(completed.values()) > 0, ended


@pytest.mark.parametrize("argv, message", [
    (["--pools", "0"], "--pools 0: must be at least 1"),
    (["--tp", "3"], "--tp 3: must divide the 4 attention heads of tiny"),
    (["--nodes", "9", "--tp", "1"], "--nodes 9: at most 6"),
    (["--port", "70000"], "--port 70000: must be a TCP port in [1, 65535]"),
    (["--idle-tick", "0"], "--idle-tick 0.0: must be positive"),
    (["--idle-tick", "300", "--timeout", "600"], "--idle-tick 300.0: must be well inside --timeout"),
    (["--kv-tokens-per-node", "8"], "--kv-tokens-per-node 8: must hold at least one block"),
    (["--layers", "0"], "--layers 0: must be at least 1"),
    (["--frontend-replicas", "0"], "--frontend-replicas 0: must be at least 1"),
    (["--max-sequence-length", "2048"], "--max-sequence-length 2048: must be in [1, 1024]"),
    (["--attention-backend", "flashy"], "--attention-backend flashy: not usable on cpu; choose one of "),
    (["--timeout", "inf"], "--timeout inf: must be positive (seconds) and at most 1000000000"),
    (["--seed", str(2**64)], f"--seed {2**64}: must fit in 64 bits (signed)"),
    (["--step-log", "{tmp}/missing/steps.jsonl"], "--step-log {tmp}/missing/steps.jsonl: its directory "
                                                  "{tmp}/missing does not exist"),
    (["--host", "256.1.1.1"], "--host 256.1.1.1: not an address of this machine"),
    (["--kv-tokens-per-node", str(10**12)], f"--kv-tokens-per-node {10**12}: "),
    (["--load", "{tmp}", "--layers", "2"], "--layers cuts a preset (--model): not with --load / --hf / --model-config"),
], ids=["pools", "tp", "nodes", "port", "idle_tick", "idle_tick_timeout", "kv", "layers", "frontend_replicas",
        "max_sequence_length", "attention_backend", "timeout_inf", "seed_64_bits", "step_log_folder", "host",
        "kv_beyond_memory", "layers_with_load"])
def test_bad_flags_are_one_line_before_any_process(argv, message, capsys, tmp_path):
    from tests.helpers import load_job_module

    argv, message = [a.format(tmp=tmp_path) for a in argv], message.format(tmp=tmp_path)
    assert load_job_module("serve_tknp").main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("serve_tknp.py: error: ") and message in err and "\n" not in err, err


def test_a_model_limit_no_block_table_holds_is_one_line_and_the_job_serves_its_own(capsys, tmp_path):
    """A model whose ``max_sequence_length`` is 10**8: the server's block tables (a row of
    blocks per request slot) would need 24 GiB on every rank, refused in one line naming the
    flag that bounds them; the main job sizes its engine for its own requests and runs."""
    from tests.helpers import load_job_module, run_main_job

    config = tmp_path / "model.json"
    config.write_text(json.dumps(dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                      ffn_hidden_size=128, vocab_size=256, max_sequence_length=10**8,
                                      normalization="RMSNorm", gated_linear_unit=True, activation="silu",
                                      add_bias_linear=False)))
    assert load_job_module("serve_tknp").main(["--model-config", str(config), "--block-size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("serve_tknp.py: error: requests of up to 100000000 tokens in 4-token blocks: a block table "
                   "of 23.9 GiB on every rank (257 request slots x 25000000 blocks), over 1 GiB; bound the "
                   "length with --max-sequence-length"), err
    status, out, err = run_main_job("--model-config", config, "--nodes", "2", "--tp", "1", "--requests", "3",
                                    "--output-len", "3", "--block-size", "4", "--json", tmp_path / "job.json")
    assert status == 0, err[-3000:]
    assert json.loads((tmp_path / "job.json").read_text())["match_reference"] is True


CHAT_MESSAGES = [{"role": "system", "content": "the quick model"}, {"role": "user", "content": "decodes tokens"}]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """A one-pool server with a tokenizer folder that has a chat template, over seeded weights
    on the tokenizer's ids only (so replies have text); yields it with the ids
    transformers' template gives :data:`CHAT_MESSAGES`. The last test here stops it."""
    transformers = pytest.importorskip("transformers")
    from tests.helpers import CHAT_TEMPLATE, make_tiny_tokenizer

    tmp_path = tmp_path_factory.mktemp("chat")
    folder = make_tiny_tokenizer(tmp_path / "tok", chat_template=CHAT_TEMPLATE)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    templated = hf.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = hf(templated, add_special_tokens=False)["input_ids"]
    config = tmp_path / "model.json"
    config.write_text(json.dumps(dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                      ffn_hidden_size=128, vocab_size=len(hf), max_sequence_length=256,
                                      normalization="RMSNorm", gated_linear_unit=True, activation="silu",
                                      add_bias_linear=False)))
    s = Server("--pools", "1", "--nodes", "2", "--tp", "1", "--model-config", str(config), "--tokenizer", str(folder),
               "--idle-tick", "0.5")
    s.tokenizer_folder = folder
    yield s, ids
    if s.proc.poll() is None:
        s.kill()


def test_the_legacy_api_with_a_tokenizer_folder(chat_server):
    """``PUT /api`` with text a real tokenizer encodes: the prompt's ids (with ``add_BOS``,
    the tokenizer's BOS first) followed by the greedy tokens that ``/v1/completions`` gives
    for those ids, the whole sequence's text, and one segment per token."""
    s, _ = chat_server
    from tknp_megatron.models.tokenizer import Tokenizer

    tok = Tokenizer(s.tokenizer_folder)
    reply = requests.put(s.url + "/api", timeout=120, json=dict(prompts=["the quick model decodes"],
                                                                tokens_to_generate=5, top_k=1, add_BOS=True))
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["tokens"][0]
    ids = tok.tokenize("the quick model decodes")
    assert tok.bos is not None and tokens[: len(ids) + 1] == [tok.bos] + ids and len(tokens) <= len(ids) + 6
    plain = requests.post(s.url + "/v1/completions", timeout=120,
                          json=dict(prompt=[tok.bos] + ids, max_tokens=5, temperature=0)).json()["choices"][0]
    if "generation_token_ids" in plain:  # 0.17+; 0.16 answers the text alone
        assert tokens[len(ids) + 1:] == plain["generation_token_ids"]
    else:
        assert tok.detokenize(tokens[len(ids) + 1:]) == plain["text"]
    assert reply.json()["text"] == [tok.detokenize(tokens)]
    assert reply.json()["segments"] == [[tok.detokenize([t]) for t in tokens]]


def test_chat_completions_apply_the_tokenizers_chat_template(chat_server):
    """``/v1/chat/completions`` with a tokenizer folder that has a chat template: Megatron's
    endpoint renders the messages through it (``Tokenizer.apply_chat_template``) and the
    reply is the greedy continuation of exactly transformers' templated ids, as
    ``/v1/completions`` gives it for those ids."""
    s, ids = chat_server
    chat = requests.post(s.url + "/v1/chat/completions", timeout=120,
                         json=dict(messages=CHAT_MESSAGES, max_tokens=6, temperature=0))
    plain = requests.post(s.url + "/v1/completions", timeout=120,
                          json=dict(prompt=ids, max_tokens=6, temperature=0, logprobs=2))
    assert chat.status_code == 200 and plain.status_code == 200, (chat.text, plain.text)
    text = plain.json()["choices"][0]["text"]
    assert text and chat.json()["choices"][0]["message"]["content"] == text
    # the chat endpoint's log-probs: the generated tokens' (it never asks for the prompt's)
    chat = requests.post(s.url + "/v1/chat/completions", timeout=120,
                         json=dict(messages=CHAT_MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                   top_logprobs=2))
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert choice["message"]["content"] == text
    # megatron-core's chat endpoint reads a field (`log_probs`) its requests lack, so it answers
    # null (0.16) or an empty list (0.17+) where its engine has them; what it does give is checked
    content = (choice["logprobs"] or {}).get("content") or []
    if content:
        expected = plain.json()["choices"][0]["logprobs"]["token_logprobs"][-len(content):]
        assert [c["logprob"] for c in content] == pytest.approx(expected, abs=1e-4)
        assert all(len(c["top_logprobs"]) == 2 for c in content)
    # only the completion routes' bodies are checked: other routes answer as the app does
    assert requests.post(s.url + "/health", timeout=30, data="x").status_code == 405
    assert requests.post(s.url + "/nowhere", timeout=30, json={}).status_code == 404


@pytest.mark.parametrize("messages, message", [
    ([{"content": "hi"}], "'messages'[0].role None: must be one of system, developer, user, assistant, tool"),
    ([{"role": "user"}], "'messages'[0].content: expected text, got NoneType"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "expected text, got a list of content parts"),
    (["hi"], "'messages'[0] 'hi': expected an object with 'role' and 'content'"),
    ("hi", "'messages' 'hi': expected a list of messages, got str"),
    ([{"role": "user", "content": "\ud800"}], "'messages': not valid Unicode"),
], ids=["no_role", "no_content", "content_parts", "string_message", "string_messages", "lone_surrogate"])
def test_chat_messages_no_template_renders_as_asked_get_400(chat_server, messages, message):
    """A chat template renders a missing role or content as empty text, and a list of content
    parts as its Python repr: such messages are answered 400 naming the message, not served."""
    s, _ = chat_server
    r = requests.post(s.url + "/v1/chat/completions", timeout=120, json=dict(messages=messages, max_tokens=2))
    assert r.status_code == 400 and message in r.text, (r.status_code, r.text)


def test_seeded_chat_choices_draw_apart_and_again_alike(chat_server):
    """A chat request's ``n`` choices are ``n`` engine requests with one seed: each draws with
    its own index, so they differ, and the same request gives the same choices again."""
    s, _ = chat_server

    def choices():
        r = requests.post(s.url + "/v1/chat/completions", timeout=120, json=dict(
            messages=CHAT_MESSAGES, max_tokens=8, temperature=1.5, n=3, seed=7))
        assert r.status_code == 200, r.text
        return [c["message"]["content"] for c in r.json()["choices"]]

    first = choices()
    assert len(first) == 3 and len(set(first)) > 1, first
    assert choices() == first


def test_megatrons_stop_ends_the_server_in_order(chat_server):
    """Megatron's STOP through its coordinator (after PAUSE, as 0.17+ requires): the pool
    stops, the launcher exits 0 and no process is left. (It stops the chat server, after
    the test above has used it.)"""
    s, _ = chat_server

    async def use(client):
        await _pause(client)
        acked = client.stop_engines()  # 0.16 answers an awaitable of the STOP_ACK
        if acked is not None:
            await asyncio.wait_for(acked, 30)
        await asyncio.sleep(1.0)  # let the signal leave before the socket closes

    _with_megatron_client(s, use)
    assert s.proc.wait(60) == 0, s.log()
    assert any("ended (STOP)" in line for line in s.lines), s.lines
    assert s.left_after(15) == []


def test_a_port_in_use_is_refused_before_any_process(capsys):
    from tests.helpers import load_job_module
    from tknp_megatron.launch import free_port

    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        assert load_job_module("serve_tknp").main(["--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"serve_tknp.py: error: --port {port}: cannot be bound on 127.0.0.1") and "\n" not in err


def test_a_rank_killed_mid_decode_fails_open_requests_and_every_process_exits():
    s = Server("--nodes", "2", "--tp", "1", make=True)  # as the README's `make serve`
    try:
        def ask(i):
            body = dict(prompt=[1, 2, 3, i], max_tokens=1000, temperature=0)
            r = requests.post(s.url + "/v1/completions", json=body, timeout=120)
            return r, time.monotonic()

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ask, i) for i in range(8)]
            time.sleep(1.0)  # decoding (1000 steps take several seconds)
            killed_at = time.monotonic()
            os.kill(s.info["rank_pids"][1], signal.SIGKILL)
            replies = [f.result() for f in futures]
        in_flight = [r for r, t in replies if t > killed_at]
        assert in_flight, "every request ended before the kill: nothing was tested"
        for r in in_flight:  # (one that ended on its end token before the kill is fine)
            # a transient failure (the server's, not the request's): 500, not 400
            assert r.status_code == 500 and "pool 0 failed" in r.text, (r.status_code, r.text)
        assert s.proc.wait(60) != 0
        assert s.left_after(15) == []
    finally:
        if s.proc.poll() is None:
            s.kill()
