"""Token-parallel process groups on real gloo pools.

Starting a pool costs seconds of Megatron import per rank, so one spawn of 4 processes
does everything: the world of 4 goes through its (N, T) shapes in turn (initialise,
check, destroy, re-initialise); then the default group is torn down and the processes
form two independent worlds of 2, then four worlds of 1, each going through its shapes.
The workers only observe (coordinates, collective results, Megatron's getters, errors);
the parent checks the observations against the layout rank = node * T + tp_rank.
"""


import pytest
import torch

from tknp_megatron.launch import spawn

SHAPES_BY_WORLD = {4: [(2, 2), (4, 1), (1, 4)], 2: [(2, 1), (1, 2)], 1: [(1, 1)]}
POOL = max(SHAPES_BY_WORLD)
TIMEOUT_S = 120


def _members(group) -> list:
    """Global ranks of ``group`` in group-rank order, found by an all_gather of ranks."""
    import torch.distributed as dist

    mine = torch.tensor([dist.get_rank()])
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(t) for t in out]


def _rank_sum(group) -> int:
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total, group=group)
    return int(total)


def _raises(fn, *args, **kwargs) -> str:
    """The name of the exception ``fn`` raises, or "" if it returns."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported to the parent by type
        return type(exc).__name__
    return ""


def _observe(ps, num_nodes: int, tp_size: int, pass_n: bool) -> dict:
    """Initialise one shape, record what the rank sees, destroy it."""
    from megatron.core import parallel_state as mpu

    n_arg = num_nodes if pass_n else None
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, token_parallel_size=n_arg)
    obs = dict(
        initialized=ps.model_parallel_is_initialized(),
        same_object=ps.get_groups() is groups,
        num_nodes=groups.num_nodes,
        tp_size=groups.tp_size,
        node=groups.node,
        tp_rank=groups.tp_rank,
        coordinator=groups.is_coordinator,
        layout={(n, t): groups.global_rank(n, t) for n in range(num_nodes) for t in range(tp_size)},
        own_tp_layout=[ps.get_token_parallel_global_rank(n) for n in range(num_nodes)],
        tknp_ranks=list(groups.tknp_ranks),
        tknp_rank=ps.get_token_parallel_rank(),
        tknp_world=ps.get_token_parallel_world_size(),
        tknp_members=_members(ps.get_token_parallel_group()),
        tknp_sum=_rank_sum(ps.get_token_parallel_group()),
        tp_members=_members(ps.get_tensor_model_parallel_group()),
        tp_sum=_rank_sum(groups.tp_group),
        mpu_tp_rank=mpu.get_tensor_model_parallel_rank(),
        mpu_tp_world=mpu.get_tensor_model_parallel_world_size(),
        mpu_dp_rank=mpu.get_data_parallel_rank(),
        mpu_dp_world=mpu.get_data_parallel_world_size(),
        mpu_pp_world=mpu.get_pipeline_model_parallel_world_size(),
        mpu_tp_members=_members(mpu.get_tensor_model_parallel_group()),
        tp_group_is_megatrons=groups.tp_group is mpu.get_tensor_model_parallel_group(),
        mpu_dp_members=_members(mpu.get_data_parallel_group()),
        outside_pool=_raises(groups.global_rank, num_nodes, 0) + "," + _raises(groups.global_rank, 0, tp_size),
        twice=_raises(ps.initialize_model_parallel, tensor_model_parallel_size=tp_size),
    )
    obs["tknp_sum_after_twice"] = _rank_sum(ps.get_token_parallel_group())  # still usable
    ps.destroy_model_parallel()
    obs["after_destroy"] = (ps.model_parallel_is_initialized(), _raises(ps.get_groups))
    return obs


def _run_shapes(world: int, shapes) -> dict:
    """Run every shape in ``shapes`` in the current world; bad sizes are tried before each."""
    import parallel_state as ps

    out = {"bad_sizes": [], "shapes": []}
    for i, (n, t) in enumerate(shapes):
        # bad sizes first: they must raise without leaving anything initialised
        for bad in [dict(tensor_model_parallel_size=t, token_parallel_size=n + 1),
                    dict(tensor_model_parallel_size=world + 1),
                    dict(tensor_model_parallel_size=0),
                    dict(tensor_model_parallel_size=-1),
                    dict(tensor_model_parallel_size=t, token_parallel_size=0)]:
            raised = _raises(ps.initialize_model_parallel, **bad)
            out["bad_sizes"].append((bad, raised, ps.model_parallel_is_initialized()))
        out["shapes"].append(_observe(ps, n, t, pass_n=i % 2 == 0))
    return out


def pools_worker(rank: int, world: int, shapes_by_world) -> dict:
    """Run the shapes of the launch world, then of smaller worlds carved out of it."""
    import torch.distributed as dist

    from tknp_megatron.launch import _rendezvous, init_distributed

    out = {world: _run_shapes(world, shapes_by_world[world])}
    smaller = sorted((s for s in shapes_by_world if s < world), reverse=True)
    # each later world's rendezvous: a store its leader binds now (the OS picks the port),
    # its port sent to every rank before the launch world goes
    stores = [_rendezvous(TIMEOUT_S) if rank % size == 0 else None for size in smaller]
    ports = [None] * world
    dist.all_gather_object(ports, [store.port if store else None for store in stores])
    dist.destroy_process_group()
    for i, size in enumerate(smaller):
        leader = rank - rank % size
        init_distributed("gloo", rank % size, size, TIMEOUT_S, store_port=ports[leader][i])
        out[size] = _run_shapes(size, shapes_by_world[size])
        dist.destroy_process_group()
    return out


def _expected(rank: int, n: int, t: int) -> dict:
    """The layout rank = node * T + tp_rank, written out."""
    node, tp_rank = divmod(rank, t)
    tknp = [m * t + tp_rank for m in range(n)]
    tp = [node * t + k for k in range(t)]
    return dict(
        initialized=True,
        same_object=True,
        num_nodes=n,
        tp_size=t,
        node=node,
        tp_rank=tp_rank,
        coordinator=rank == 0,
        layout={(m, k): m * t + k for m in range(n) for k in range(t)},
        own_tp_layout=tknp,
        tknp_ranks=tknp,
        tknp_rank=node,
        tknp_world=n,
        tknp_members=tknp,
        tknp_sum=sum(tknp),
        tp_members=tp,
        tp_sum=sum(tp),
        mpu_tp_rank=tp_rank,
        mpu_tp_world=t,
        mpu_dp_rank=node,  # Megatron's DP group is the token-parallel group here
        mpu_dp_world=n,
        mpu_pp_world=1,
        mpu_tp_members=tp,
        tp_group_is_megatrons=True,
        mpu_dp_members=tknp,
        outside_pool="ValueError,ValueError",
        twice="RuntimeError",
        tknp_sum_after_twice=sum(tknp),
        after_destroy=(False, "RuntimeError"),
    )


@pytest.fixture(scope="module")
def pool_results():
    """Per process of the pool, per world size, what that process observed."""
    results = spawn(pools_worker, POOL, (SHAPES_BY_WORLD,), timeout_s=TIMEOUT_S)
    assert len(results) == POOL
    return results


@pytest.mark.parametrize("world", sorted(SHAPES_BY_WORLD))
def test_token_parallel_groups(pool_results, world):
    shapes = SHAPES_BY_WORLD[world]
    for proc, res in enumerate(pool_results):
        rank = proc % world  # the process's rank in its world of this size
        for (n, t), obs in zip(shapes, res[world]["shapes"], strict=True):
            expected = _expected(rank, n, t)
            wrong = {k: (obs[k], v) for k, v in expected.items() if obs[k] != v}
            assert not wrong, f"rank {rank}/{world} of ({n}, {t}): (got, expected) {wrong}"
        assert len(res[world]["bad_sizes"]) == 5 * len(shapes)
        for sizes, raised, initialized in res[world]["bad_sizes"]:
            assert raised == "ValueError", f"rank {rank}/{world}: {sizes} raised {raised or 'nothing'}"
            assert not initialized
