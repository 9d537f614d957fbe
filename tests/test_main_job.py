"""The main job (examples/run_tknp_decode.py) with a user's flags (run in the test's
process, its pool spawned as a user's is: tests/helpers.py, ``run_main_job``).

(a) No arguments: the seeded tiny model on 2 nodes x TP2, 16 requests in >= 2 waves,
    tokens equal to the reference's, and the JSON keys the README promises.
(b) ``--load``: a checkpoint written by plain Megatron-Core (GPTModel at TP=2, vocab 300
    padded to 512 -- not the 384 a TP=1 model would pad to) served at N=2, T=1 from
    ``--model-config``; the reference loads the same checkpoint.
(c) ``--tokenizer`` / ``--prompt``: a tiny BPE tokenizer trained in the test and a model
    from ``--model-config`` whose vocabulary is the tokenizer's; decoded ``texts``.
(``--hf`` is run by tests/test_multi_host.py, converted on each of two torchrun hosts,
and by tests/test_trained_model.py.)
The reference is the test in every case: match_reference must be true.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from tests.helpers import (
    load_job_module,
    make_tiny_tokenizer,
    run_main_job,
    save_gpt_checkpoint,
)
from tknp_megatron.launch import spawn

REQUIRED = (
    "match_reference", "requests", "completed", "rejected", "outputs", "owners", "waves",
    "kv_capacity_tokens", "completion_throughput_tok_s", "queue_wait_s_mean", "itl_p95_s",
    "completion_time_s_mean",
)
# The ``tiny`` architecture as a --model-config file, with a vocabulary of our choosing.
TINY_CONFIG = dict(
    name="tiny-config", num_layers=6, hidden_size=64, num_attention_heads=4,
    num_query_groups=2, kv_channels=16, ffn_hidden_size=160, normalization="RMSNorm",
    gated_linear_unit=True, add_bias_linear=False, activation="silu", vocab_size=300,
    max_sequence_length=1024, rotary_base=10000,
)


def _run_job(out: Path, *args) -> dict:
    status, stdout, stderr = run_main_job("--json", out, *args)
    assert status == 0, stdout + stderr
    return json.loads(out.read_text())


def save_worker(rank, world, config, ckpt_dir):
    """Plain Megatron-Core: a seeded GPTModel at TP=2, dist_checkpointing.save."""
    warnings.simplefilter("ignore")
    from tknp_megatron.models.model_config import preset_from_model_config

    save_gpt_checkpoint(preset_from_model_config(config), 2, ckpt_dir, seed=11)


def test_default_job(tmp_path):
    report = _run_job(tmp_path / "out.json")
    missing = [k for k in REQUIRED if k not in report]
    assert not missing, missing
    assert report["match_reference"] is True
    assert report["completed"] == report["requests"] == 16 and report["rejected"] == 0
    assert report["waves"] >= 2
    assert len(report["outputs"]) == len(report["owners"]) == 16
    assert "texts" not in report and report["weights"].startswith("seeded")


def test_megatron_checkpoint_job(tmp_path):
    ckpt, config = tmp_path / "ckpt", tmp_path / "model.json"
    config.write_text(json.dumps(TINY_CONFIG))
    ckpt.mkdir()
    spawn(save_worker, 2, (TINY_CONFIG, str(ckpt)), timeout_s=120)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 17, 299, 2], [9, 9, 1, 44, 200, 3, 7], [250]]))
    report = _run_job(tmp_path / "out.json", "--load", ckpt, "--model-config", config,
                      "--prompts-file", prompts, "--nodes", 2, "--tp", 1, "--output-len", 6)
    assert report["match_reference"] is True, report
    assert report["completed"] == 3 and report["model"] == "tiny-config"
    assert report["weights"] == f"checkpoint {ckpt}"


def test_tokenizer_prompts(tmp_path):
    pytest.importorskip("tokenizers")
    from tknp_megatron.models.tokenizer import Tokenizer

    tok = Tokenizer(make_tiny_tokenizer(tmp_path / "tok"))
    config = tmp_path / "model.json"
    config.write_text(json.dumps({**TINY_CONFIG, "vocab_size": tok.vocab_size}))
    texts = ["the quick brown fox", "every node keeps the cache"]
    report = _run_job(tmp_path / "out.json", "--tokenizer", tmp_path / "tok",
                      "--model-config", config, "--nodes", 2, "--tp", 1, "--output-len", 8,
                      *[a for t in texts for a in ("--prompt", t)])
    assert report["match_reference"] is True and report["completed"] == 2
    assert report["texts"] == [tok.decode(ids) for ids in report["outputs"]]
    for ids in report["outputs"]:
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eos_id not in ids[:-1]  # EOS, if sampled, ended the request


def test_parse_errors_fail_before_the_pool(tmp_path):
    job = load_job_module()
    with pytest.raises(job.JobError, match="--prompt needs --tokenizer"):
        job.parse_args(["--prompt", "hello"])
    with pytest.raises(job.JobError, match="--model is a preset"):  # a preset and a checkpoint at once
        job.parse_args(["--model", "tiny", "--load", str(tmp_path)])


def test_tokenizer_eos_reaches_sampling(tmp_path):
    """The tokenizer's EOS is every request's (and the reference's) stop token."""
    pytest.importorskip("tokenizers")
    from tknp_megatron.models.tokenizer import Tokenizer

    module = load_job_module()
    tok = Tokenizer(make_tiny_tokenizer(tmp_path / "tok"))
    config = tmp_path / "model.json"
    config.write_text(json.dumps({**TINY_CONFIG, "vocab_size": tok.vocab_size}))
    args = module.parse_args(["--tokenizer", str(tmp_path / "tok"), "--model-config",
                              str(config), "--prompt", "the lazy dog"])
    job = module.prepare_job(args)
    assert job.prompts == [tok.encode("the lazy dog")]
    assert job.sampling().eos_id == tok.eos_id == 2
    config.write_text(json.dumps({**TINY_CONFIG, "vocab_size": 16}))
    with pytest.raises(ValueError, match="ids, more than the model's vocab_size 16"):
        module.prepare_job(args)
