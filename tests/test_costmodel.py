"""Capacity and traffic model: paper figures (3.2, Figure 5, 4.4) and invariants."""

import pytest

from tknp_megatron.analysis.costmodel import (
    KIB,
    MIB,
    Mode,
    NodeBudget,
    budget_from_measurement,
    budget_from_preset,
    kv_capacity,
    layer_traffic,
    placement_shares,
    split_batch,
    tp_kv_replication,
)
from tknp_megatron.config import get_preset
from tknp_megatron.placement import GIB, model_bytes

LLAMA = get_preset("llama3.1-405b")
PAPER_RATIOS = {2: 3.3, 4: 4.4, 8: 5.0}  # Figure 5, TKNP / DP


def _paper_budget():
    return budget_from_measurement(454, 106, gpus_per_node=8, kv_heads=8)


def test_paper_capacity_ratios_within_six_percent():
    budget = _paper_budget()
    for n, paper in PAPER_RATIOS.items():
        cap = kv_capacity(budget, n)
        assert cap.tknp_over_dp == pytest.approx((n * 560 - 454) / (n * 106))
        assert abs(cap.tknp_over_dp / paper - 1) < 0.06, (n, cap.tknp_over_dp)
    assert [round(kv_capacity(budget, n).tknp_over_dp, 2) for n in (2, 4, 8)] == [3.14, 4.21, 4.75]


def test_paper_layouts_on_eight_nodes():
    cap = kv_capacity(_paper_budget(), 8)
    assert cap.dp == pytest.approx(848)  # "the combined budget of eight DP replicas"
    assert cap.tknp == cap.pp == cap.dcp == pytest.approx(8 * 560 - 454)
    assert cap.tp == pytest.approx((8 * 560 - 454) / 8)  # 64 GPUs, 8 KV heads
    assert cap.tknp_dual == pytest.approx(8 * 560 - 2 * 454)
    assert 2016 / 106 == pytest.approx(19, abs=0.05) and 2016 / cap.dp == pytest.approx(2.4, abs=0.05)


def test_one_node_every_layout_is_dp():
    cap = kv_capacity(_paper_budget(), 1)
    for layout in (Mode.DP, Mode.TP, Mode.PP, Mode.DCP, Mode.TKNP):
        assert cap.of(layout) == pytest.approx(106)
    assert cap.tknp_dual is None and cap.tknp_over_dp == pytest.approx(1)


def test_dual_copy_on_two_nodes_equals_dp_and_is_none_for_odd_counts():
    budget = _paper_budget()
    assert kv_capacity(budget, 2).tknp_dual == pytest.approx(kv_capacity(budget, 2).dp)
    assert kv_capacity(budget, 3).tknp_dual is None


def test_tp_replication():
    assert tp_kv_replication(8, 8) == 1 and tp_kv_replication(8, 4) == 1
    assert tp_kv_replication(8, 32) == 4


def test_budget_from_preset_arithmetic():
    weights = model_bytes(LLAMA, 1, 2)
    budget = budget_from_preset(LLAMA, 8, 80, mem_util=0.9, reserve_gib=2, weights=weights)
    assert budget.node_gib == pytest.approx(8 * (80 * 0.9 - 2))
    assert budget.copy_gib == pytest.approx(weights.total / GIB)
    assert budget.kv_heads == 8
    with pytest.raises(ValueError, match="mem_util"):
        budget_from_preset(LLAMA, 8, 80, mem_util=1.5)


def test_meta_fp8_checkpoint_bytes_match_the_papers_454_gib():
    """FP8 MLPs in layers 1..124, attention, edge layers and embeddings in BF16."""
    meta = model_bytes(LLAMA, 1, 2, attention_bytes=2, edge_layers_at_other_bytes=1)
    assert meta.total / GIB == pytest.approx(454, abs=0.5)
    assert model_bytes(LLAMA, 1, 2).total / GIB == pytest.approx(381.9, abs=0.1)


def test_shares_and_a_node_that_cannot_fit():
    weights = model_bytes(LLAMA, 1, 2)
    assert sum(placement_shares(weights, 4)) == pytest.approx(1)
    assert sum(placement_shares(weights, 4, dual=True)) == pytest.approx(2)
    budget = NodeBudget(node_gib=300, copy_gib=454, gpus_per_node=8, kv_heads=8)
    cap = kv_capacity(budget, 2)
    assert cap.dp == 0 and cap.tknp_over_dp is None and cap.tknp_dual == 0
    assert cap.tknp == pytest.approx(600 - 454)


def test_paper_traffic_llama_405b_four_tp8_nodes_batch_128():
    t = layer_traffic(LLAMA, 4, 8, 128)
    assert t.owner_batches == (32, 32, 32, 32)
    assert t.scatter_bytes_per_owner == 144 * KIB
    assert t.gather_bytes_per_owner == 128 * KIB
    assert t.dcp_output_bytes == 512 * KIB
    assert t.dcp_lse_bytes == 8 * KIB
    assert t.tp_allreduce_bytes == 4 * MIB
    assert t.eq3_bytes == 816 * KIB
    assert t.gather_bytes_per_owner / t.dcp_output_bytes == pytest.approx(1 / 4)  # eq. 5
    assert t.gather_bytes_per_owner * 4 * 8 == t.tp_allreduce_bytes  # 1/(N T), Hq d_h = D


# the closed form assumes T divides Hkv, so combinations where it does not are left out
EQ3_CASES = [
    (name, *shape)
    for name in ["llama3.1-405b", "nemotron4-340b", "llama3.1-70b", "tiny"]
    for shape in [(4, 8, 128, 0), (3, 2, 37, 2), (2, 1, 5, 1)]
    if get_preset(name).num_query_groups % shape[1] == 0
]


@pytest.mark.parametrize("name,nodes,tp,batch,root", EQ3_CASES)
def test_eq3_matches_the_closed_form(name, nodes, tp, batch, root):
    p = get_preset(name)
    t = layer_traffic(p, nodes, tp, batch, 2, root=root)
    remote = batch - t.owner_batches[root]
    closed = 2 * 2 * (p.num_attention_heads + p.num_query_groups) * p.kv_channels * remote / tp
    assert t.eq3_bytes == closed
    assert t.scatter_bytes[root] == t.gather_bytes[root] == 0


def test_split_and_explicit_owner_batches():
    assert split_batch(10, 4) == (3, 3, 2, 2) and split_batch(0, 2) == (0, 0)
    t = layer_traffic(LLAMA, 2, 8, 10, owner_batches=(0, 10))
    assert t.eq3_bytes == 10 * (144 + 128) * KIB // 32
    assert layer_traffic(LLAMA, 1, 8, 16).eq3_bytes == 0


def test_kv_heads_replicate_when_tp_exceeds_them():
    tiny = get_preset("tiny")  # 4 query heads, 2 KV heads, d_h 16
    t = layer_traffic(tiny, 2, 4, 4)
    assert t.scatter_bytes_per_owner == 2 * (1 + 2 * 1) * 16 * 2
    assert t.gather_bytes_per_owner == 2 * 1 * 16 * 2


def test_traffic_errors():
    with pytest.raises(ValueError, match="tp=3"):
        layer_traffic(LLAMA, 4, 3, 128)
    with pytest.raises(ValueError, match="owner batches"):
        layer_traffic(LLAMA, 2, 8, 10, owner_batches=(3, 3))
    with pytest.raises(ValueError, match="root"):
        layer_traffic(LLAMA, 2, 8, 10, root=2)
