"""The Megatron-engine peer tool (tools/bench_megatron_engine.py) on CPU: what it refuses,
in one line and before anything is built, and the arithmetic its GPU runs rely on. The
engine itself runs on the GPU machine (benchmarks/scripts/h200_megatron_peer.sh)."""

from __future__ import annotations

import pytest
import torch

from tknp_megatron.tools import bench_megatron_engine as peer


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of machines without CUDA")
def test_no_cuda_is_one_line_and_exit_2(capsys):
    code = peer.main(["--model", "tiny", "--contexts", "64", "--batches", "2", "--output-len", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("bench_megatron_engine: no CUDA device")


@pytest.mark.parametrize("argv, needle", [
    (["--replicas", "2", "--replica-index", "2"], "--replica-index 2: must be in [0, --replicas 2)"),
    (["--replicas", "2", "--tp", "2"], "--replicas 2 with --tp 2"),
    (["--batches", "0"], "--batches 0: must be >= 1"),
    (["--output-len", "0"], "--output-len 0"),
    (["--contexts", "32768", "--max-tokens", "16384"], "--max-tokens 16384: must hold the longest prompt"),
    (["--contexts", "32768", "--batches", "8", "16", "--max-tokens", "32768"],
     "--max-tokens 32768: must hold the longest prompt and a token of each other request of the largest "
     "batch (32768 + 16 - 1 = 32783"),
    (["--replicas", "4", "--batches", "2"], "--batches 2: fewer requests than --replicas 4"),
])
def test_bad_flags_are_refused_naming_the_value(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        peer.parse_args(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_the_default_pass_holds_the_longest_prompt_beside_the_batch():
    assert peer.parse_args(["--contexts", "8192", "--batches", "16", "64"]).max_tokens == 16384  # Megatron's
    assert peer.parse_args(["--contexts", "8192", "32768", "--batches", "8", "16"]).max_tokens == 32768 + 15


def test_kv_buffer_holds_every_request_with_margin():
    # 64 requests of 8192 + 128 tokens, 256-token blocks, 12 layers of 8 KV heads x 128, bf16
    gib = peer.kv_buffer_gib([8320] * 64, 256, 12, 8, 128)
    need = 64 * (33 + 1) * 256 * 2 * 12 * 8 * 128 * 2 / 2**30  # 33 blocks + 1 spare each
    assert need * 1.15 <= gib < need * 1.15 + 0.25
    assert gib == 29.5
    assert peer.kv_buffer_gib([1], 256, 1, 1, 8) == 0.25  # rounded up, never zero


@pytest.mark.parametrize("n, replicas", [(7, 1), (7, 2), (8, 3), (3, 3)])
def test_replicas_split_every_request_exactly_once(n, replicas):
    shares = [peer.replica_requests(n, replicas, i) for i in range(replicas)]
    assert sorted(r for share in shares for r in share) == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
