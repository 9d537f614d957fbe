"""Scheduler against a simple reference, over random arrivals and random completions.

The reference (:class:`RefScheduler`) keeps only counts: free blocks and free slots per
node, and per running request its node, reservation, context and cached tokens. Its rule
is the paper's: FCFS; the head of the queue goes to the eligible node (a free slot and
free blocks for prompt + max_new_tokens) with the lowest load, ties to the lowest node
id; if the head fits nowhere everyone waits. Load is the context tokens (prompt +
generated, so a request admitted this step counts at once) or the reserved tokens.
Decode progress is simulated by setting ``num_cached`` and ``generated`` on the requests.
"""

import math
import random
from collections import deque
from dataclasses import dataclass

import pytest

from tknp_megatron.engine.request import Request, RequestTimeline
from tknp_megatron.engine.scheduler import LoadPolicy, Scheduler, SchedulerConfig
from tknp_megatron.kv_cache import BlockAllocator
from tknp_megatron.sampling import SamplingParams


def _request(rid: int, prompt_len: int, max_new: int) -> Request:
    return Request(
        rid, list(range(prompt_len)), SamplingParams(max_new_tokens=max_new), RequestTimeline(release=0.0)
    )


@dataclass
class _RefEntry:
    node: int
    prompt_len: int
    reserved: int
    num_cached: int = 0
    generated: int = 0


class RefScheduler:
    """The admission rule written as plainly as possible, on counts only."""

    def __init__(self, blocks_per_node, block_size, slots, policy, max_prefill_tokens):
        self.free_blocks = list(blocks_per_node)
        self.free_slots = [slots] * len(blocks_per_node)
        self.block_size = block_size
        self.policy = policy
        self.budget = max_prefill_tokens
        self.waiting = deque()  # (request_id, prompt_len, max_new)
        self.running = {}  # request_id -> _RefEntry
        self.waves = 0
        self.blocked = False

    def load(self, node):
        entries = [e for e in self.running.values() if e.node == node]
        if self.policy is LoadPolicy.RESERVED:
            return sum(e.reserved for e in entries)
        return sum(e.prompt_len + e.generated for e in entries)

    def cached(self, node):
        return sum(e.num_cached for e in self.running.values() if e.node == node)

    def schedule(self):
        """Admit what fits; returns [(request_id, node)] in admission order."""
        admitted, budget = [], self.budget
        while self.waiting:
            rid, prompt_len, max_new = self.waiting[0]
            need = math.ceil((prompt_len + max_new) / self.block_size)
            nodes = [
                n
                for n in range(len(self.free_blocks))
                if self.free_slots[n] > 0 and self.free_blocks[n] >= need
            ]
            if not nodes:
                self.blocked = True
                break
            if admitted and prompt_len > budget:
                break
            if self.blocked or self.waves == 0:
                self.waves += 1
                self.blocked = False
            node = min(nodes, key=lambda n: (self.load(n), n))
            self.waiting.popleft()
            self.free_blocks[node] -= need
            self.free_slots[node] -= 1
            self.running[rid] = _RefEntry(node, prompt_len, prompt_len + max_new)
            admitted.append((rid, node))
            budget -= prompt_len
        return admitted

    def finish(self, rid):
        e = self.running.pop(rid)
        self.free_blocks[e.node] += math.ceil(e.reserved / self.block_size)
        self.free_slots[e.node] += 1


def _advance(req: Request) -> None:
    """One step of the request: cache everything pending, generate one token."""
    req.num_cached = len(req.prompt) + len(req.generated)
    req.generated.append(0)


def _check_node_invariants(sched: Scheduler, ref: RefScheduler) -> None:
    for n, alloc in enumerate(sched.allocators):
        reqs = sched.running[n]
        assert alloc.num_free == ref.free_blocks[n]
        slots = [r.slot for r in reqs]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < sched.config.max_requests_per_node for s in slots)
        blocks = [b for r in reqs for b in r.blocks]
        assert len(set(blocks)) == len(blocks)  # no block held twice on a node
        assert len(blocks) + alloc.num_free == alloc.num_blocks
        for r in reqs:
            assert r.owner == n
            assert len(r.blocks) == alloc.blocks_for(r.reserved_tokens)
            assert r.num_cached <= r.reserved_tokens
    util, reserved = sched.kv_utilization(), sched.reserved_fraction()
    assert len(util) == len(reserved) == sched.num_nodes
    for n, alloc in enumerate(sched.allocators):
        assert 0.0 <= util[n] <= 1.0 and 0.0 <= reserved[n] <= 1.0
        assert util[n] == pytest.approx(ref.cached(n) / alloc.capacity_tokens)
        assert reserved[n] == pytest.approx(1 - ref.free_blocks[n] / alloc.num_blocks)


def _simulate(seed: int, policy: LoadPolicy) -> Scheduler:
    rng = random.Random(seed)
    num_nodes = rng.randint(1, 4)
    block_size = rng.choice([1, 4, 8])
    blocks = [rng.randint(4, 24) for _ in range(num_nodes)]
    slots = rng.randint(1, 5)
    budget = rng.choice([1 << 30, rng.randint(4, 40)])
    clock_now = [0.0]
    sched = Scheduler(
        SchedulerConfig(policy=policy, max_requests_per_node=slots, max_prefill_tokens=budget),
        [BlockAllocator(b, block_size) for b in blocks],
        clock=lambda: clock_now[0],
    )
    ref = RefScheduler(blocks, block_size, slots, policy, budget)
    fit = sched.max_fit_tokens()
    scale = rng.choice([0.15, 1.0])  # small requests run many at once; large ones queue
    assert fit == max(blocks) * block_size
    owner_at_admission, next_id, finished = {}, 0, []
    for step in range(3000):
        clock_now[0] = float(step)
        if next_id < 40:
            for _ in range(rng.choice([0, 0, 1, 2, 5])):  # arrivals, sometimes in bursts
                max_new = rng.randint(1, max(1, int(fit * scale) // 3))
                prompt_len = rng.randint(1, max(1, int(fit * scale) - max_new))
                req = _request(next_id, prompt_len, max_new)
                sched.enqueue(req)
                ref.waiting.append((next_id, prompt_len, max_new))
                next_id += 1
        result = sched.schedule()
        expected = ref.schedule()
        assert [(r.request_id, r.owner) for r in result.admitted] == expected
        assert [a.request_id for a in result.admissions] == [rid for rid, _ in expected]
        for req, adm in zip(result.admitted, result.admissions):
            assert (adm.owner, adm.slot, adm.blocks, adm.ingest_len) == (
                req.owner, req.slot, tuple(req.blocks), 0
            )
            assert req.timeline.first_scheduled == float(step)
            owner_at_admission[req.request_id] = req.owner
        assert sched.waves == ref.waves
        assert sorted(r.request_id for r in result.batch) == sorted(ref.running)
        assert [r.owner for r in result.batch] == sorted(r.owner for r in result.batch)
        for req in result.batch:
            assert req.owner == owner_at_admission[req.request_id]  # ownership never changes
            _advance(req)
            entry = ref.running[req.request_id]
            entry.num_cached, entry.generated = req.num_cached, len(req.generated)
        _check_node_invariants(sched, ref)
        for req in result.batch:
            if req.finished() or rng.random() < 0.05:  # max tokens, or an early EOS
                sched.finish(req)
                ref.finish(req.request_id)
                assert req.blocks == [] and req.owner == owner_at_admission[req.request_id]
                finished.append(req.request_id)
        _check_node_invariants(sched, ref)
        if next_id >= 40 and not sched.has_work():
            break
    assert not sched.has_work() and sched.num_running() == 0
    assert sorted(finished) == list(range(next_id))
    assert all(a.num_free == a.num_blocks for a in sched.allocators)  # every block came back
    assert sched.reserved_fraction() == [0.0] * num_nodes
    assert all(len(s) == slots for s in sched._free_slots)
    return sched


@pytest.mark.parametrize("policy", list(LoadPolicy))
@pytest.mark.parametrize("seed", range(12))
def test_matches_reference(seed, policy):
    _simulate(seed, policy)


def test_everything_fits_is_one_wave():
    sched = Scheduler(SchedulerConfig(), [BlockAllocator(64, 4) for _ in range(2)], clock=lambda: 0.0)
    reqs = [_request(i, 10, 6) for i in range(8)]
    for r in reqs:
        sched.enqueue(r)
    result = sched.schedule()
    assert len(result.admitted) == 8 and sched.waves == 1
    while sched.has_work():
        for r in sched.schedule().batch:
            _advance(r)
            if r.finished():
                sched.finish(r)
    assert sched.waves == 1


def test_capacity_pressure_makes_waves():
    # one node, room for two reservations of 8 tokens: six requests come in three waves
    sched = Scheduler(SchedulerConfig(), [BlockAllocator(4, 4)], clock=lambda: 0.0)
    for i in range(6):
        sched.enqueue(_request(i, 4, 4))
    sizes = []
    while sched.has_work():
        result = sched.schedule()
        if result.admitted:
            sizes.append(len(result.admitted))
        for r in result.batch:
            _advance(r)
            if r.finished():
                sched.finish(r)
    assert sizes == [2, 2, 2]
    assert sched.waves == 3


def test_head_of_line_blocks_everyone():
    sched = Scheduler(SchedulerConfig(), [BlockAllocator(4, 4), BlockAllocator(4, 4)], clock=lambda: 0.0)
    big = [_request(i, 6, 6) for i in range(2)]  # 3 of a node's 4 blocks each
    for r in big:
        sched.enqueue(r)
    assert [r.owner for r in sched.schedule().admitted] == [0, 1]
    head, small = _request(2, 10, 6), _request(3, 1, 1)  # 4 blocks; 1 block
    sched.enqueue(head)
    sched.enqueue(small)  # fits on either node, but must not overtake the head
    for _ in range(3):
        assert sched.schedule().admitted == ()
        assert small.owner == -1 and list(sched.waiting) == [head, small]
    sched.finish(big[1])
    result = sched.schedule()
    assert [(r.request_id, r.owner) for r in result.admitted] == [(2, 1), (3, 0)]
    assert sched.waves == 2


def test_max_prefill_tokens_budget():
    config = SchedulerConfig(max_prefill_tokens=10)
    sched = Scheduler(config, [BlockAllocator(100, 4)], clock=lambda: 0.0)
    for i, n in enumerate([4, 5, 3, 20, 2]):
        sched.enqueue(_request(i, n, 1))
    # 4 + 5 fit; 3 would exceed what is left (1) and nothing behind it may overtake
    assert [r.request_id for r in sched.schedule().admitted] == [0, 1]
    assert [r.request_id for r in sched.schedule().admitted] == [2]  # 3 + 20 > 10
    assert [r.request_id for r in sched.schedule().admitted] == [3]  # over budget alone: allowed
    assert [r.request_id for r in sched.schedule().admitted] == [4]
    assert sched.waves == 1  # a budget stop is not a capacity wave


def test_ties_go_to_lowest_node_and_policies_differ():
    def run(policy):
        sched = Scheduler(
            SchedulerConfig(policy=policy), [BlockAllocator(100, 4) for _ in range(2)], lambda: 0.0
        )
        a, b, c = _request(0, 2, 50), _request(1, 10, 2), _request(2, 1, 1)
        sched.enqueue(a)
        sched.schedule()
        a.num_cached = 2
        sched.enqueue(b)
        sched.schedule()
        b.num_cached = 10
        sched.enqueue(c)
        sched.schedule()
        return a.owner, b.owner, c.owner

    # usage: loads (2, 10) -> node 0; reserved: loads (52, 12) -> node 1
    assert run(LoadPolicy.USAGE) == (0, 1, 0)
    assert run(LoadPolicy.RESERVED) == (0, 1, 1)
    assert SchedulerConfig(policy="reserved").policy is LoadPolicy.RESERVED


def test_slots_limit_admission():
    sched = Scheduler(
        SchedulerConfig(max_requests_per_node=2), [BlockAllocator(100, 4)], clock=lambda: 0.0
    )
    reqs = [_request(i, 2, 2) for i in range(3)]
    for r in reqs:
        sched.enqueue(r)
    assert [r.slot for r in sched.schedule().admitted] == [0, 1]
    sched.finish(reqs[0])
    assert [r.slot for r in sched.schedule().admitted] == [0]
    with pytest.raises(ValueError):
        SchedulerConfig(max_requests_per_node=0)


def test_usage_counts_requests_admitted_in_the_same_step():
    # two nodes, nothing cached yet: the second admission of a step sees the first's prompt
    sched = Scheduler(SchedulerConfig(), [BlockAllocator(100, 4) for _ in range(2)], lambda: 0.0)
    reqs = [_request(0, 8, 2), _request(1, 3, 2), _request(2, 4, 2)]
    for r in reqs:
        sched.enqueue(r)
    sched.schedule()
    # loads after each admission: (8, 0) -> node 1; (8, 3) -> node 1; (8, 7)
    assert [r.owner for r in reqs] == [0, 1, 1]
