"""The README's multi-host commands, run as two torchrun "hosts" on this machine.

Each "host" is its own torchrun agent with its own temporary directory; the agents meet
through torchrun's c10d rendezvous over loopback, exactly as agents on separate machines
meet at ``$HEAD``. Only the sizes change (CPU, gloo, tiny models):

(a) the main job, two hosts of TP2 serving a Hugging Face folder that each host converts
    itself: its tokens equal the reference's, and both hosts own requests;
(b) the server, a pool on each host behind Megatron's coordinator on rank 0: the pool on
    the other host registers over TCP, both pools serve, the tokens equal the offline
    engine's, and signalling every host's torchrun stops everything in order;
(c) the serving harness, TKNP (a node per host), DP (a replica per host) and TP (one node
    across both) on one trace: every mode completes it and agrees on tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests

from tests.helpers import make_hf_llama
from tests.test_readme import commands
from tknp_megatron.launch import free_port, spawn

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


def readme_command(script: str, **flags) -> list:
    """The README's multi-host command for ``script`` as argv, with ``flags`` (``--name``
    spelled ``name``, dashes as underscores) set to new values; None drops a flag."""
    (cmd,) = [c for c, _ in commands() if "--nnodes" in c and script in c]
    words = shlex.split(cmd)
    assert words[0] == "torchrun"
    words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    new = {"--" + k.replace("_", "-"): v for k, v in flags.items()}
    out, i = [], 0
    while i < len(words):
        word = words[i]
        if word in new:
            if new.pop(word) is not None:
                out += [word, str(flags[word[2:].replace("-", "_")])]
            i += 2
            continue
        out.append(word)
        i += 1
    assert not new, f"the README's command has no {sorted(new)}"
    return out


class Hosts:
    """One torchrun agent per "host", each with its own temporary directory; their
    stdout lines, and every process of their trees."""

    def __init__(self, argv: list, hosts: int, tmp: Path, extra: list = ()):
        self.procs, self.lines = [], []
        for h in range(hosts):
            env = dict(os.environ, TMPDIR=str(tmp / f"host{h}"))
            Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
            self.procs.append(subprocess.Popen([*argv, *extra], cwd=ROOT, env=env, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for p in self.procs:
            threading.Thread(target=self._read, args=(p,), daemon=True).start()
        self.tree = [p.pid for p in self.procs]

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def log(self, n: int) -> str:
        """The last ``n`` lines, without the reference-leak report that Triton's bindings
        print as a process exits (dozens of lines that would hide the error above them)."""
        kept = [x for x in self.lines if not re.match(r"\s*(nanobind: |- leaked |- \.\.\. skipped)", x)]
        return "\n".join(kept[-n:])

    def wait(self, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        return [p.wait(max(1.0, deadline - time.monotonic())) for p in self.procs]

    def add_children(self):
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                self.tree += [c.pid for c in psutil.Process(p.pid).children(recursive=True)]

    def alive(self) -> list:
        return [p for p in self.tree if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]

    def kill(self):
        self.add_children()
        for p in self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def _rendezvous(name: str) -> dict:
    return dict(nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id=f"{name}-{uuid.uuid4().hex[:8]}",
                device="cpu")


def test_main_job_on_two_hosts_of_tp2(tmp_path):
    pytest.importorskip("transformers")
    make_hf_llama(tmp_path / "hf", None)  # Llama, 3 layers, GQA 4/2, vocab 256
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4], [100, 200, 5], [7, 8], [9, 10, 11, 12, 13]]))
    out = tmp_path / "out.json"
    argv = readme_command("run_tknp_decode.py", nproc_per_node=2, nodes=2, tp=2, hf=tmp_path / "hf",
                          **_rendezvous("job"))
    hosts = Hosts(argv, 2, tmp_path, ["--prompts-file", str(prompts), "--output-len", "5",
                                      "--json", str(out)])
    try:
        codes = hosts.wait(TIMEOUT_S)
    finally:
        hosts.kill()
    assert codes == [0, 0], hosts.log(60)
    assert not [line for line in hosts.lines if "TKNP:" in line]  # progress lines only on a terminal
    report = json.loads(out.read_text())
    assert report["match_reference"] is True and report["completed"] == 4
    assert report["model"] == "hf" and sorted(set(report["owners"])) == [0, 1]
    left = [list((tmp_path / f"host{h}").glob("tknp-hf-*")) for h in (0, 1)]
    assert left == [[], []], "each host removes its own conversion"


def test_server_with_a_pool_on_each_host(tmp_path):
    from tests.test_server import MAX_TOKENS, _prompts, _tokens, offline_worker

    port = free_port()
    argv = readme_command("serve_tknp.py", nproc_per_node=1, pools=2, nodes=1, tp=1, hf=None,
                          host="127.0.0.1", **_rendezvous("serve"))
    hosts = Hosts(argv, 2, tmp_path, ["--port", str(port), "--idle-tick", "0.5"])
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(" ready " in line for line in hosts.lines):
            assert time.monotonic() < deadline and all(p.poll() is None for p in hosts.procs), \
                hosts.log(60)
            time.sleep(0.5)
        hosts.add_children()
        ready = json.loads(next(x for x in hosts.lines if " ready " in x).split(" ready ", 1)[1])
        assert ready["pools"] == 2 and ready["url"] == f"http://127.0.0.1:{port}"

        prompts = _prompts(16, seed=5)

        def ask(p):
            body = dict(prompt=p, max_tokens=MAX_TOKENS, temperature=0)
            return requests.post(ready["url"] + "/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(ask, prompts))
        failed = [r.text for r in replies if r.status_code != 200]
        assert not failed, "\n".join(failed[:2]) + "\n" + hosts.log(80)  # the servers' own log says why
        served = [tuple(_tokens(r.json()["choices"][0])) for r in replies]
        offline, _ = spawn(offline_worker, 2, (prompts, []), timeout_s=TIMEOUT_S)[0]
        assert served == [tuple(t) for t in offline] and all(served)

        for p in hosts.procs:  # what a batch scheduler's cancel does
            p.send_signal(signal.SIGTERM)
        hosts.wait(90)
        ended = {int(line.split("pool ")[1].split()[0]): int(line.split("): ")[1].split()[0])
                 for line in hosts.lines if " ended " in line}
        assert sorted(ended) == [0, 1] and min(ended.values()) > 0, hosts.log(40)
        deadline = time.monotonic() + 15
        while hosts.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert hosts.alive() == []
    finally:
        hosts.kill()


def test_serving_harness_across_two_hosts(tmp_path):
    out = tmp_path / "hosts"
    argv = readme_command("bench_serving", nproc_per_node=1, tp=1, model="tiny", contexts=64, batches=4,
                          out=out, **_rendezvous("bench"))
    hosts = Hosts(argv, 2, tmp_path, ["--output-len", "4", "--kv-tokens-per-node", "512"])
    try:
        codes = hosts.wait(TIMEOUT_S)
    finally:
        hosts.kill()
    assert codes == [0, 0], hosts.log(60)
    result = json.loads((out / "results.json").read_text())
    assert [r["mode"] for r in result["rows"]] == ["TKNP", "DP", "TP"]
    assert all(r["completed"] == 4 for r in result["rows"])
    assert result["tokens_agree"] and all(v == 1.0 for v in result["tokens_agree"].values())
