"""Byte-balanced layer-block placement: exact against brute force, layouts, presets, errors."""

import itertools
import random

import pytest

from tknp_megatron.config import get_preset
from tknp_megatron.placement import (
    Handoff,
    ModelBytes,
    Placement,
    balance_contiguous,
    balanced_placement,
    model_bytes,
    placement_from_bytes,
)


def _sums(layer_bytes, blocks, first_extra, last_extra):
    sums = [sum(layer_bytes[s:e]) for s, e in blocks]
    sums[0] += first_extra
    sums[-1] += last_extra
    return sums


def _objective(sums, dual):
    if not dual:
        return max(sums)
    half = len(sums) // 2
    return max(sums[b] + sums[b + half] for b in range(half))


def _brute_force(layer_bytes, num_blocks, first_extra, last_extra, dual=False):
    """Smallest objective over every partition into non-empty contiguous blocks."""
    n = len(layer_bytes)
    best = None
    for cuts in itertools.combinations(range(1, n), num_blocks - 1):
        edges = (0,) + cuts + (n,)
        blocks = list(zip(edges[:-1], edges[1:]))
        value = _objective(_sums(layer_bytes, blocks, first_extra, last_extra), dual)
        best = value if best is None else min(best, value)
    return best


def _random_case(rng):
    """Layers mixing 'FP8' and 'BF16' sizes, sometimes huge endpoints."""
    n = rng.randint(1, 11)
    base = rng.randint(1, 50)
    layer_bytes = [base * rng.choice([1, 2]) + rng.choice([0, 0, 1, 7]) for _ in range(n)]
    if rng.random() < 0.2:
        layer_bytes[rng.randrange(n)] *= 20  # one outsized layer
    first = rng.choice([0, base, 3 * base, 40 * base])
    last = rng.choice([0, base, 3 * base, 40 * base])
    return layer_bytes, first, last


def _check_tiling(blocks, n, k):
    assert len(blocks) == k
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(s < e for s, e in blocks)
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))


def test_single_copy_is_exact_against_brute_force():
    rng = random.Random(1234)
    for _ in range(600):
        layer_bytes, first, last = _random_case(rng)
        k = rng.randint(1, len(layer_bytes))
        blocks = balance_contiguous(layer_bytes, k, first, last)
        _check_tiling(blocks, len(layer_bytes), k)
        got = max(_sums(layer_bytes, blocks, first, last))
        assert got == _brute_force(layer_bytes, k, first, last), (layer_bytes, k, first, last)


def test_dual_copy_is_exact_against_brute_force():
    rng = random.Random(99)
    cases = 0
    while cases < 400:
        layer_bytes, first, last = _random_case(rng)
        n = len(layer_bytes)
        if n < 2:
            continue
        k = 2 * rng.randint(1, n // 2)
        weights = ModelBytes(tuple(layer_bytes), first, last)
        placement = placement_from_bytes(weights, k, dual=True)
        _check_tiling(placement.blocks, n, k)
        sums = _sums(layer_bytes, placement.blocks, first, last)
        assert max(placement.node_bytes) == _objective(sums, dual=True)
        assert max(placement.node_bytes) == _brute_force(layer_bytes, k, first, last, dual=True)
        cases += 1


def test_node_bytes_cover_the_model_once_or_twice():
    preset = get_preset("llama3.1-405b")
    total = model_bytes(preset, 1, 2).total
    assert sum(balanced_placement(preset, 4, linear_bytes=1).node_bytes) == total
    assert sum(balanced_placement(preset, 4, linear_bytes=1, dual=True).node_bytes) == 2 * total


def test_single_copy_roots_and_storage():
    p = balanced_placement(get_preset("tiny"), 3)
    assert p.num_layers == 6 and not p.dual
    for layer in range(6):
        b = p.block_of_layer(layer)
        assert p.blocks[b][0] <= layer < p.blocks[b][1]
        assert p.root_of_layer(layer) == b
        assert layer in p.layers_of_node(b)
    assert p.first_root() == 0 and p.last_root() == 2
    assert [p.holds_embedding(n) for n in range(3)] == [True, False, False]
    assert [p.holds_output(n) for n in range(3)] == [False, False, True]
    assert p.handoffs() == tuple(Handoff(p.blocks[b][0], b - 1, b) for b in (1, 2))
    with pytest.raises(ValueError, match="microbatch"):
        p.root_of_layer(0, microbatch=1)


def test_dual_copy_layout():
    preset = get_preset("llama3.1-405b")
    p = balanced_placement(preset, 4, linear_bytes=1, dual=True)
    assert [p.blocks_of_node(n) for n in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    block_sums = _sums(model_bytes(preset, 1, 2).layers, p.blocks,
                       model_bytes(preset, 1, 2).embedding, model_bytes(preset, 1, 2).output)
    for n in range(4):
        assert p.node_bytes[n] == block_sums[n] + block_sums[(n + 2) % 4]
    for layer in range(p.num_layers):
        b = p.block_of_layer(layer)
        assert p.root_of_layer(layer, 0) == b
        assert p.root_of_layer(layer, 1) == (b + 2) % 4
        for mb in (0, 1):
            assert layer in p.layers_of_node(p.root_of_layer(layer, mb))
    assert p.first_root(0) == 0 and p.first_root(1) == 2
    assert p.last_root(0) == 3 and p.last_root(1) == 1
    assert [n for n in range(4) if p.holds_embedding(n)] == [0, 2]
    assert [n for n in range(4) if p.holds_output(n)] == [1, 3]
    assert [(h.from_node, h.to_node) for h in p.handoffs(1)] == [(2, 3), (3, 0), (0, 1)]
    with pytest.raises(ValueError, match="microbatch"):
        p.root_of_layer(0, microbatch=2)


def test_dual_copy_on_two_nodes_stores_everything_everywhere():
    p = balanced_placement(get_preset("tiny"), 2, dual=True)
    assert p.layers_of_node(0) == p.layers_of_node(1) == tuple(range(6))
    assert p.root_of_layer(0, 1) == 1 and p.root_of_layer(5, 1) == 0


@pytest.mark.parametrize("name", ["llama3.1-405b", "nemotron4-340b"])
@pytest.mark.parametrize("linear_bytes", [1, 2])
def test_paper_models_balance_within_five_percent_on_four_nodes(name, linear_bytes):
    p = balanced_placement(get_preset(name), 4, linear_bytes=linear_bytes)
    assert max(p.node_bytes) / min(p.node_bytes) - 1 < 0.05
    # endpoints are counted: the first and last blocks hold fewer layers than the middle
    sizes = [e - s for s, e in p.blocks]
    assert sizes[0] < max(sizes[1:3]) and sizes[-1] < max(sizes[1:3])


def test_one_node_holds_everything():
    p = balanced_placement(get_preset("tiny"), 1)
    assert p.blocks == ((0, 6),) and p.handoffs() == ()
    assert p.holds_embedding(0) and p.holds_output(0)
    assert p.node_bytes == (model_bytes(get_preset("tiny")).total,)


def test_describe_lists_every_node():
    text = balanced_placement(get_preset("tiny"), 4, dual=True).describe()
    assert len(text.splitlines()) == 5 and "embedding" in text and "output" in text


def test_errors():
    with pytest.raises(ValueError, match="3 layers into 4"):
        balance_contiguous([1, 2, 3], 4)
    with pytest.raises(ValueError, match="num_blocks"):
        balance_contiguous([1, 2, 3], 0)
    with pytest.raises(ValueError, match=r"num_nodes=7 exceeds num_layers=6"):
        balanced_placement(get_preset("tiny"), 7)
    with pytest.raises(ValueError, match="even"):
        balanced_placement(get_preset("tiny"), 3, dual=True)
    with pytest.raises(ValueError, match="num_nodes"):
        balanced_placement(get_preset("tiny"), 0)
    with pytest.raises(ValueError, match="tile"):
        Placement(2, 6, ((0, 2), (3, 6)), False, (1, 1))
    with pytest.raises(ValueError, match="even"):
        Placement(3, 6, ((0, 2), (2, 4), (4, 6)), True, (1, 1, 1))
    p = balanced_placement(get_preset("tiny"), 2)
    with pytest.raises(ValueError, match="layer 6"):
        p.block_of_layer(6)
    with pytest.raises(ValueError, match="node 2"):
        p.layers_of_node(2)
