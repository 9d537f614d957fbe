"""The roofline step-time model: calibration points, scaling, and the modes' structure."""

import pytest

from tknp_megatron.analysis.roofline import H200, dense_gemm_s, predicted_step_s, tknp_step_parts
from tknp_megatron.config import get_preset

L70 = get_preset("llama3.1-70b")


def test_dense_calibration_points_and_scaling():
    for rows, t in zip(H200.dense_rows, H200.dense_s):
        assert dense_gemm_s(H200, rows, H200.dense_ref_bytes) == pytest.approx(t)
    assert dense_gemm_s(H200, 8, H200.dense_ref_bytes) == pytest.approx(400e-6)  # weight-read bound
    assert dense_gemm_s(H200, 96, H200.dense_ref_bytes) == pytest.approx((478e-6 + 619e-6) / 2)
    assert dense_gemm_s(H200, 64, H200.dense_ref_bytes / 2) == pytest.approx(478e-6 / 2)  # TP2 slice


@pytest.mark.parametrize("mode", ["tknp", "tknp-dual", "dp", "tp", "pp", "dcp"])
def test_monotonic_in_batch_and_context(mode):
    f = lambda b, c: predicted_step_s(mode, L70, 2, 1, b, c)  # noqa: E731
    assert f(16, 32768) < f(64, 32768) < f(128, 32768)
    assert f(64, 8192) < f(64, 32768) < f(64, 65536)


def test_tknp_eight_layers_matches_hand_count():
    p = L70.replace(num_layers=8)
    kv = 2 * 2 * 32 * 32768 * 8 * 128  # one owner's K+V bytes per layer, B=64 over 2 nodes
    exch = 2 * (21e-6 + 32 * (10240 + 8192) * 2 / 336e9)
    logits = 478e-6 * (2 * 128256 * 8192) / H200.dense_ref_bytes
    expected = 8 * (478e-6 + kv / 4.3e12 + exch) + logits
    assert predicted_step_s("tknp", p, 2, 1, 64, 32768) == pytest.approx(expected)
    parts = tknp_step_parts(p, 2, 1, 64, 32768)  # what a profile of the step is held against
    assert parts.gemm == pytest.approx(8 * 478e-6) and parts.logits == pytest.approx(logits)
    assert parts.attention == pytest.approx(8 * kv / 4.3e12) and parts.exchange == pytest.approx(8 * exch)
    assert parts.allreduce == 0 and parts.total == pytest.approx(expected)


def test_dp_is_a_one_node_pool_per_replica():
    p = L70.replace(num_layers=8)
    one = tknp_step_parts(p, 1, 1, 32, 32768)
    assert one.exchange == 0
    assert predicted_step_s("dp", p, 2, 1, 64, 32768) == pytest.approx(one.total)
    assert predicted_step_s("tknp", p, 1, 1, 32, 32768) == pytest.approx(one.total)


def test_dual_root_pays_dense_twice_and_splits_attention():
    """Per layer two half-phases, each a root's dense work at B/2 plus its owner share of
    the other microbatch's attention: with flat dense cost, dual only wins when attention
    is small next to a second dense pass (the model states the schedule's critical path)."""
    p = L70.replace(num_layers=8)
    single = predicted_step_s("tknp", p, 4, 1, 128, 32768)
    dual = predicted_step_s("tknp-dual", p, 4, 1, 128, 32768)
    per_owner = 128 / 8
    kv = 2 * 2 * per_owner * 32768 * 8 * 128
    exch = 2 * (21e-6 + per_owner * (10240 + 8192) * 2 / 336e9)
    logits = 478e-6 * (2 * 128256 * 8192) / H200.dense_ref_bytes
    assert dual == pytest.approx(8 * 2 * (478e-6 + kv / 4.3e12 + exch) + 2 * logits)
    assert dual > single


def test_tp_replicates_kv_past_the_kv_heads_and_dcp_does_not():
    mqa = L70.replace(num_query_groups=1)
    tp = predicted_step_s("tp", mqa, 2, 1, 64, 32768)
    dcp = predicted_step_s("dcp", mqa, 2, 1, 64, 32768)
    assert dcp < tp  # DCP reads half the sequence per GPU, TP reads all of it on both


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="unknown mode"):
        predicted_step_s("ep", L70, 2, 1, 8, 1024)


def test_across_hosts_the_network_is_paid():
    """The network constants reproduce the paper's Figure 4 (at B=128 on Llama 3.1 405B an
    all-reduce over 64 GPUs costs 6.5x one over a host's 8); a pool wider than a host pays
    them, the same pool inside one NVLink domain does not."""
    import dataclasses

    from tknp_megatron.analysis.roofline import _allreduce_s

    l405 = get_preset("llama3.1-405b")
    assert _allreduce_s(H200, 128, l405, 64) / _allreduce_s(H200, 128, l405, 8) == pytest.approx(6.5, rel=0.01)
    one_domain = dataclasses.replace(H200, gpus_per_host=64)
    for mode in ("tknp", "tp", "pp", "dcp"):
        assert predicted_step_s(mode, l405, 32, 8, 128, 32768) > predicted_step_s(
            mode, l405, 32, 8, 128, 32768, one_domain), mode
    assert predicted_step_s("dp", l405, 32, 8, 128, 32768) == predicted_step_s(
        "dp", l405, 32, 8, 128, 32768, one_domain)  # replicas never leave their host


def test_fp8_weights_halve_the_dense_time():
    p = L70.replace(num_layers=8)
    bf16, fp8 = (predicted_step_s("dp", p, 1, 1, 64, 0, weight_elem=e) for e in (2.0, 1.0))
    assert bf16 - fp8 == pytest.approx(8 * 478e-6 / 2)  # the logits layer stays BF16


def test_the_papers_dual_schedule_overlaps_dense_and_attention():
    """Two chains on two roots sharing the owners: a layer is the longer of one chain (dense
    at B/2, exchange, attention of one microbatch) and both microbatches' attention; so it
    is never slower per step than a single copy, and this repository's schedule (the two
    half-phases add up) is never faster than it."""
    p = L70.replace(num_layers=8)
    for batch, ctx in ((16, 4096), (64, 32768), (128, 131072)):
        paper = predicted_step_s("tknp-dual-paper", p, 4, 1, batch, ctx)
        assert paper <= predicted_step_s("tknp", p, 4, 1, batch, ctx)
        assert paper <= predicted_step_s("tknp-dual", p, 4, 1, batch, ctx)
    per_owner = 128 / 8
    attn = 2 * 2 * per_owner * 131072 * 8 * 128 / 4.3e12
    logits = 478e-6 * (2 * 128256 * 8192) / H200.dense_ref_bytes  # the last roots, B/2 each, at once
    assert predicted_step_s("tknp-dual-paper", p, 4, 1, 128, 131072) == pytest.approx(8 * 2 * attn + logits)


def test_hardware_is_chosen_by_the_gpu_name():
    from tknp_megatron.analysis.roofline import H100, H200, hardware_for

    assert hardware_for("NVIDIA H100 80GB HBM3") is H100
    assert hardware_for("NVIDIA H200") is H200
    assert hardware_for("cpu (dry run)") is H200
    assert H100.kv_bw < H200.kv_bw
