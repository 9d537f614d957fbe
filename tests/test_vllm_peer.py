"""The vLLM peer tool (tools/bench_vllm.py) on CPU: what it refuses, in one line and before
anything is built, the Hugging Face config.json it hands vLLM, and the arithmetic of its decode
figures. vLLM itself runs on the GPU machine (benchmarks/scripts/h200_vllm_peer.sh)."""

from __future__ import annotations

import json
import sys

import pytest

from tknp_megatron.config import get_preset
from tknp_megatron.tools import bench_vllm as peer

SMALL = ["--model", "tiny", "--contexts", "64", "--batches", "2", "--output-len", "4"]


def test_missing_vllm_is_one_line_naming_it_and_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # vllm not importable, installed or not
    code = peer.main(SMALL)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("bench_vllm: vllm is not installed")
    assert "vllm_wheels.txt" in err[0]


@pytest.mark.parametrize("argv, needle", [
    (["--replicas", "2", "--replica-index", "2"], "--replica-index 2: must be in [0, --replicas 2)"),
    (["--replicas", "2", "--tp", "2"], "--replicas 2 with --tp 2"),
    (["--batches", "0"], "--batches 0: must be >= 1"),
    (["--contexts", "-5"], "--contexts -5: must be >= 1"),
    (["--output-len", "1"], "--output-len 1: must be >= 2"),
    (["--replicas", "4", "--batches", "2"], "--batches 2: fewer requests than --replicas 4"),
    (["--tp", "3"], "--tp 3: must divide the 64 attention heads of llama3.1-70b"),
    (["--gpu-memory-gib", "0"], "--gpu-memory-gib 0.0: must be > 0"),
    (["--max-num-seqs", "8", "--batches", "16", "64"], "--max-num-seqs 8: fewer than the 64 requests"),
    (["--layers", "0"], "--layers 0: must be >= 1"),
    (["--model", "nemotron4-340b"], "--model nemotron4-340b: not a Llama architecture"),
    (["--model", "llama9"], "--model llama9: unknown model preset 'llama9'"),
])
def test_bad_flags_are_refused_naming_the_value(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        peer.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1]


def test_max_num_seqs_defaults_to_a_replicas_largest_batch():
    assert peer.parse_args(["--batches", "16", "64"]).max_num_seqs == 64
    assert peer.parse_args(["--batches", "16", "65", "--replicas", "2", "--replica-index", "1"]).max_num_seqs == 32


def test_config_json_has_the_presets_geometry(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # --config-only needs no vllm
    argv = ["--model", "llama3.1-70b", "--layers", "12", "--contexts", "8192", "--output-len", "128",
            "--config-only", str(tmp_path)]
    assert peer.main(argv) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "config.json")
    cfg = json.loads((tmp_path / "config.json").read_text())
    p = get_preset("llama3.1-70b")
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 12
    assert (cfg["hidden_size"], cfg["intermediate_size"]) == (p.hidden_size, p.ffn_hidden_size) == (8192, 28672)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        p.num_attention_heads, p.num_query_groups, p.kv_channels) == (64, 8, 128)
    assert cfg["vocab_size"] == p.vocab_size == 128256
    assert cfg["rms_norm_eps"] == p.layernorm_epsilon
    assert cfg["rope_theta"] == p.gpt.rotary_base == 500000
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": p.gpt.rope_scaling_factor,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}
    assert cfg["max_position_embeddings"] == p.gpt.max_sequence_length >= 8192 + 128
    assert cfg["hidden_act"] == "silu" and not cfg["attention_bias"] and not cfg["mlp_bias"]
    assert cfg["tie_word_embeddings"] is p.gpt.share_embeddings_and_output_weights is False
    assert cfg["torch_dtype"] == "bfloat16"
    assert 0 <= cfg["bos_token_id"] < cfg["vocab_size"] and 0 <= cfg["eos_token_id"] < cfg["vocab_size"]


def test_config_without_rope_scaling_and_longer_contexts(tmp_path):
    tiny = get_preset("tiny")  # no rope scaling, 1024 positions
    cfg = json.loads((peer.write_model_dir(tiny, 4096, tmp_path) / "config.json").read_text())
    assert cfg["rope_scaling"] is None and cfg["rope_theta"] == tiny.gpt.rotary_base
    assert cfg["max_position_embeddings"] == 4096  # the trace's prompt + output, beyond the preset's 1024
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (6, 2, 512)


def test_decode_figures_from_the_two_generate_calls():
    # 64 requests, 128 tokens: 10 s with max_tokens=1, 12.54 s with 128 -> 127 steps in 2.54 s
    got = peer.decode_figures(10.0, 12.54, 64, 128)
    assert got["decode_step_ms"] == pytest.approx(20.0)
    assert got["decode_tok_s"] == pytest.approx(64 * 127 / 2.54)
    assert peer.decode_figures(3.0, 2.9, 8, 16) == dict(decode_step_ms=None, decode_tok_s=None)


@pytest.mark.parametrize("n, replicas", [(7, 1), (7, 2), (8, 3), (3, 3)])
def test_replicas_split_every_request_exactly_once(n, replicas):
    shares = [peer.replica_requests(n, replicas, i) for i in range(replicas)]
    assert sorted(r for share in shares for r in share) == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
