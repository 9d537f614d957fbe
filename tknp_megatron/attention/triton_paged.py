"""The Triton backend ("triton"): split-K paged decode, and a varlen kernel for prefill.

Decode (``max_query_len <= 1``) launches ``_paged_attn_kernel`` over
``(R, Hkv, num_splits)``: each program reads one slice of one request's context for one
kv head, for all query heads of that group, so K/V is read once per group. The number
of splits fills the GPU with one resident wave: at most ``waves * num_SMs`` programs in
total, at least ``min_split_tokens`` context tokens per split, at most ``max_splits``.
With more than one split the fp32 partials are merged by their log-sum-exp: by the last
program of each request's slices where the launch is balanced (below), else by a second
small kernel. The tile and pipeline depth are chosen per shape (:func:`decode_launch`,
from the sweeps in ``docs/ARCHITECTURE.md``). With ``TritonConfig.balance > 1`` (the
default: 2) the slices are cut by tokens, the same length for every request, so a long
request gets more slices than a short one; a small kernel plans them on the device from
``seq_lens`` (a work list that is the grid). Grid sizes come from host ints only (``R``,
``max_seq_len``), so there is no device sync.

Prefill or mixed batches (``max_query_len > 1``) run the same kernel over query tiles
(``BLOCK_Q`` rows x the head group); a tile -> request map is built on the device with
``searchsorted``. ``prefill="sdpa"`` uses the torch gather + SDPA path instead.
The kernels module is imported on first use, so ``TRITON_INTERPRET`` set before that
is honoured (CPU tests run the kernels in Triton's interpreter).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

import torch

from tknp_megatron.attention.base import AttentionBackend, AttentionMetadata, CallShape, PreparedLaunch
from tknp_megatron.attention.registry import register_backend
from tknp_megatron.attention.sdpa import sdpa_paged

__all__ = [
    "DecodeLaunch",
    "TritonConfig",
    "TritonPagedBackend",
    "choose_num_splits",
    "decode_launch",
    "triton_importable",
    # Launch helpers shared with other callers of the kernels (DCP's partial attention):
    "H200_NUM_SMS",
    "decode_group_pad",
    "device_num_sms",
    "interpreter_upcast",
    "load_kernels",
    "next_pow2",
    "triton_interpreting",
    "triton_supports_device",
]

H200_NUM_SMS = 132
"""SMs the split heuristic assumes when no GPU is present (interpreter runs)."""


@dataclass(frozen=True)
class TritonConfig:
    """Launch parameters of the Triton backend.

    Attributes:
        block_n: context tokens per inner-loop tile (power of two, >= 16); ``None``: per
            shape (:func:`decode_launch` for decode, :func:`prefill_tile` for prompts).
        num_warps: warps per program of the attention kernel (``None``: per shape).
        num_stages: software-pipelining stages of the inner loop (``None``: per shape).
        num_splits: fixed number of KV splits (e.g. for CUDA graphs); ``None`` picks it
            per step with :func:`choose_num_splits`.
        max_splits: upper bound of the heuristic. 256: one request at 128K with one KV
            head took 1.68x SDPA's time on an H200 at 64 splits (half the SMs idle) and
            1.09x at 256 (``benchmarks/RESULTS.md``, "Paged decode attention per shape").
        min_split_tokens: fewest context tokens the heuristic gives a split.
        waves: programs per SM the heuristic fills the GPU with (one resident wave).
        balance: decode with mixed lengths: ``> 1`` cuts every request's context into
            slices of the same number of tokens (the step's tokens over the split budget),
            and a request may take up to ``balance`` times the heuristic's splits, so the
            longest may take that many times its share; 1 cuts each request's own context
            into the heuristic's number of equal slices; ``None``: 2 (:func:`decode_launch`)
            where the launch covers at least ``balance_min_work`` KV head-tokens.
        balance_min_work: with ``balance`` left ``None``, the fewest KV head-tokens
            (programs x longest context) a launch covers for it to be balanced; below, the
            plan kernel's few microseconds cost more than balancing saves. ``None``:
            ``BALANCE_MIN_WORK``. An explicit ``balance`` always balances.
        prefill: ``"triton"`` (varlen kernel) or ``"sdpa"`` for ``max_query_len > 1``.
        prefill_rows: matrix rows of a varlen (prompt) tile, query positions times the
            head group (power of two >= 16); ``None``: per head dim (:func:`prefill_tile`).
        fused_merge: balanced decode launches of at most ``FUSED_MERGE_MAX_SLICES`` slices a
            request merge them in the attention kernel (the last program of each request and
            KV head to finish), instead of in a merge kernel launched after it
            (``docs/ARCHITECTURE.md``, "Paged decode attention").
    """

    block_n: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    num_splits: Optional[int] = None
    max_splits: int = 256
    min_split_tokens: int = 256
    waves: int = 4
    balance: Optional[int] = None
    balance_min_work: Optional[int] = None
    prefill: str = "triton"
    prefill_rows: Optional[int] = None
    fused_merge: bool = True

    def __post_init__(self) -> None:
        if self.block_n is not None and (self.block_n < 16 or self.block_n & (self.block_n - 1)):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        for name in ("num_warps", "num_stages"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        balance = 1 if self.balance is None else self.balance
        if self.max_splits < 1 or self.min_split_tokens < 1 or self.waves < 1 or balance < 1:
            raise ValueError("max_splits, min_split_tokens, waves and balance must be >= 1")
        if self.balance_min_work is not None and self.balance_min_work < 0:
            raise ValueError(f"balance_min_work must be >= 0, got {self.balance_min_work}")
        if self.prefill_rows is not None and (self.prefill_rows < 16 or self.prefill_rows & (self.prefill_rows - 1)):
            raise ValueError(f"prefill_rows must be a power of two >= 16, got {self.prefill_rows}")
        if self.prefill not in ("triton", "sdpa"):
            raise ValueError(f"prefill must be 'triton' or 'sdpa', got {self.prefill!r}")


def choose_num_splits(programs: int, max_kv_len: int, num_sms: int, config: TritonConfig) -> int:
    """KV splits so that ``programs * splits`` fills one resident wave: at most
    ``waves * num_sms`` programs (rounded down: a second wave that is only partly full
    leaves the GPU partly idle for as long as the first; on an H200, 768 programs of the
    default tile took 1.4x as long per byte as 512).

    Args:
        programs: programs without splitting (query tiles x kv heads).
        max_kv_len: longest context in the step (host int).
        num_sms: streaming multiprocessors of the GPU.
    """
    if config.num_splits is not None:
        return config.num_splits
    want = config.waves * num_sms // max(programs, 1)
    by_length = max(1, max_kv_len // config.min_split_tokens)
    return max(1, min(want, by_length, config.max_splits))


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch parameters of one decode call of the kernel.

    Attributes:
        num_splits: KV slices per request (balanced: the most one request takes).
        block_n, num_warps, num_stages: the tile and pipeline depth.
        budget_splits: 0, or (balanced splits) the slices per request the step's tokens
            are spread over on average; ``num_splits`` is then the most one request gets.
    """

    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    budget_splits: int = 0

    @property
    def partials(self) -> bool:
        """Whether the launch writes fp32 partials that a merge combines."""
        return self.num_splits > 1 or self.budget_splits > 0


FUSED_MERGE_MAX_SLICES = 16
"""The most slices a request of a balanced launch may take for the attention kernel to merge
them itself (``TritonConfig.fused_merge``). One program then reads all of its request's
slices at the end of the launch: at 32 (B = 32 x 32K, one KV head) that tail took longer than
the merge kernel, which spreads the same reads over every (row, head) (on an H100, head dim
192: 301 against 295 us a call; at 16 slices or fewer the kernel's own merge was 0-2 % faster,
``benchmarks/RESULTS.md``, "The last slice merges")."""


BALANCE_MIN_WORK = 1 << 19  # KV head-tokens (programs x longest context): TritonConfig.balance_min_work


LARGE_GROUP = 32  # query heads per KV head from which a decode launch takes the large-group tile


def decode_launch(programs: int, max_kv_len: int, head_dim: int, num_sms: int, config: TritonConfig,
                  balanced: bool = False, group: int = 1) -> DecodeLaunch:
    """The splits (:func:`choose_num_splits`) and the tile of a decode launch, per shape.

    Fields set in ``config`` win; the others follow the H200 sweeps of
    ``tools/bench_attention.py`` (``docs/ARCHITECTURE.md``, "Paged decode attention"):

    - fewer programs than SMs (small batches and short contexts, launch-bound): 128-token
      tiles, so each program has fewer steps of its loop;
    - head dims over 128 (Nemotron's 192, read as column tiles of 128 and 64): 32-token
      tiles, 4 warps, 2 stages, whose registers and shared memory leave room for more
      programs per SM (64-token tiles, 2 or 8 warps, 3 or 4 stages were 4-60 % slower at
      1 and 8 KV heads on an H200);
    - groups of ``LARGE_GROUP`` query heads per KV head or more (one KV head at TP 1-2 of a
      64-head model, as the DCP and TKNP-MQA rows run), at head dims up to 128: 32-token
      tiles, 4 warps, 2 stages. Each tile then feeds 32-64 matrix rows, so the dots and the
      softmax weigh as much as the loads; on an H200 at 64 and 32 query heads per KV head
      (B = 32 / 128, 8K-64K) they took 0.87-0.91x the time of the 64-token tile, the best
      of eight tiles at 8 of 12 shapes (128-token tiles with 8 warps at the other four, by
      1-3.5 %; ``benchmarks/RESULTS.md``, "Large head groups"). FA3 is faster still there
      (``per_shape.py``);
    - otherwise 64-token tiles, 4 warps and a third pipeline stage, which hides more of
      each program's memory latency: with one split (the batch fills the GPU by itself)
      4-8 % faster than two stages; with several, a median 3 % and up to 13 % on the
      long-context shapes of ``benchmarks/RESULTS.md`` ("Paged decode attention per shape").

    With ``balanced`` (callers whose merge reads only the slices each row has), a balance
    over 1 and more than one split, a request may take up to ``balance`` times the splits
    (at most one slice per tile of the longest context, at most 128), and the kernels'
    grid is the work list's (:func:`~tknp_megatron.attention.triton_kernels.launch_split_plan`).
    The default balance is 2. On an H200 (``benchmarks/RESULTS.md``, "Mixed lengths"), with
    lengths spread 10x it took 0.75-0.79x the time of equal slices per request at
    B x context >= 1M; with equal lengths, 0.93-1.06x (median 1.03) at head dim 128 and
    0.92-1.10x (median 0.98) at 192, plus about 4 us per call at small shapes (the plan's
    kernel). Serving batches mix lengths, so it is on by default where a launch covers at
    least ``BALANCE_MIN_WORK`` KV head-tokens (256 MiB of bf16 K and V at head dim 128,
    about 60 us of reading): at half that, balancing cost 3-10 us (4-13 %) with equal
    lengths on an H200, more than the ~4 us plan kernel alone. With one
    split the batch alone fills the GPU and the hardware hands a finished program's place
    to the next one: balancing there cost 1-30 %.

    Args:
        programs: programs without splitting (requests x kv heads).
        max_kv_len: longest context the launch covers (host int).
        head_dim: the heads' dimension.
        num_sms: streaming multiprocessors of the GPU.
        balanced: whether the caller runs balanced splits.
        group: query heads per KV head.
    """
    splits = choose_num_splits(programs, max_kv_len, num_sms, config)
    if group >= LARGE_GROUP and head_dim <= 128:
        tile = (32, 4, 2)
    elif programs * splits < num_sms:
        tile = (128, 4, 2)
    elif head_dim > 128:
        tile = (32, 4, 2)
    else:
        tile = (64, 4, 3)
    block_n, warps, stages = (given if given is not None else chosen for given, chosen in
                              zip((config.block_n, config.num_warps, config.num_stages), tile))
    balance = 2 if config.balance is None else config.balance
    if config.balance is None:
        floor = BALANCE_MIN_WORK if config.balance_min_work is None else config.balance_min_work
        balanced = balanced and programs * max_kv_len >= floor
    if balanced and balance > 1 and config.num_splits is None and splits > 1:
        grid = max(splits, min(splits * balance, -(-max_kv_len // block_n), 128))
        if grid > 1:
            return DecodeLaunch(grid, block_n, warps, stages, budget_splits=splits)
    return DecodeLaunch(splits, block_n, warps, stages)


def prefill_tile(head_dim: int, config: TritonConfig):
    """``(rows, block_n, num_warps, num_stages)`` of a varlen (prompt) launch; fields set in
    ``config`` win. Rows are matrix rows of a tile, query positions times the head group.

    - head dim above 128: 128 rows, 64-token tiles, 8 warps, 3 stages. On an H200
      (``benchmarks/RESULTS.md``, "Prompts") 0.53-0.64x the time of the tile below, on
      whole 4K and 16K prompts and on 2048-token chunks at the end of a 32K context;
      128-token tiles run out of shared memory there.
    - otherwise 64 rows, 64-token tiles, 4 warps, 2 stages. 128 rows took 0.90-0.93x its
      time on the 32K chunks but 1.00-1.02x on whole prompts, and 1.56x on one 4K prompt
      with one KV head (half the programs for 132 SMs).
    """
    wide = head_dim > 128
    rows = config.prefill_rows or (128 if wide else 64)
    tile = (64, 8, 3) if wide else (64, 4, 2)
    block_n, warps, stages = (given if given is not None else chosen for given, chosen in
                              zip((config.block_n, config.num_warps, config.num_stages), tile))
    return rows, block_n, warps, stages


def next_pow2(x: int) -> int:
    """Smallest power of two ``>= x`` (1 for ``x <= 1``)."""
    return 1 << max(0, (x - 1).bit_length())


def decode_group_pad(num_heads: int, num_kv_heads: int) -> int:
    """``group_pad`` of a decode launch: the query heads of one kv head, padded to a power
    of two and to at least 16 rows (the smallest ``tl.dot`` M)."""
    return max(16, next_pow2(num_heads // num_kv_heads))


def triton_importable() -> bool:
    """Whether ``triton`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_supports_device(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: CUDA, or any device under the interpreter."""
    return device.type == "cuda" or triton_interpreting()


def interpreter_upcast(dtype: torch.dtype) -> bool:
    """The kernels' ``upcast`` flag: the CPU interpreter cannot ``tl.dot`` bf16."""
    return triton_interpreting() and dtype == torch.bfloat16


@functools.lru_cache(maxsize=None)
def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; :data:`H200_NUM_SMS` otherwise, so
    interpreter runs pick the splits an H200 would."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_NUM_SMS


def load_kernels():
    """The :mod:`~tknp_megatron.attention.triton_kernels` module (``launch_paged_attention``,
    ``launch_combine_splits``), imported on first use so that ``TRITON_INTERPRET`` set
    before then is honoured."""
    from tknp_megatron.attention import triton_kernels

    return triton_kernels


def _tile_map(meta: AttentionMetadata, rows: int, block_q: int):
    """Device tile -> request map for varlen launches (no host sync).

    Returns:
        ``(tile_req [num_tiles] int32, tile_first [R] int32, num_tiles)``; tiles past the
        last request map to ``R`` (the kernel skips them).
    """
    q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    tiles = (q_lens + block_q - 1) // block_q
    tile_end = torch.cumsum(tiles, 0, dtype=torch.int32)
    num_req = meta.num_requests
    num_tiles = min(-(-rows // block_q) + num_req, num_req * -(-meta.max_query_len // block_q))
    ids = torch.arange(num_tiles, device=q_lens.device, dtype=torch.int32)
    tile_req = torch.searchsorted(tile_end, ids, right=True).to(torch.int32)
    return tile_req, (tile_end - tiles).to(torch.int32), num_tiles


class TritonPagedBackend(AttentionBackend):
    """Triton paged attention; see the module docstring."""

    name = "triton"

    def __init__(self, config: Optional[TritonConfig] = None, **overrides) -> None:
        self.config = dataclasses.replace(config or TritonConfig(), **overrides)

    def _forward(self, q, k_cache, v_cache, meta, scale):
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("k_cache/v_cache must be contiguous along head_dim")
        q = q if q.stride(-1) == 1 else q.contiguous()
        if meta.max_query_len <= 1:
            return self.decode(q, k_cache, v_cache, meta, scale)
        if self.config.prefill == "sdpa":
            return sdpa_paged(q, k_cache, v_cache, meta, scale)
        return self.varlen(q, k_cache, v_cache, meta, scale)

    def decode(self, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        """At most one query row per request: grid ``(R, Hkv, splits)``, group padded to 16
        rows; balanced splits (``config.balance``) when there are several requests and
        every one has its row."""
        num_req, num_kv_heads = meta.num_requests, k_cache.shape[2]
        group_pad = decode_group_pad(q.shape[1], num_kv_heads)
        launch = self._decode_launch(meta, q.shape[1], num_kv_heads, q.shape[2], q.device,
                                     balanced=1 < num_req == q.shape[0])  # the merge maps row i to request i
        return self._run(q, k_cache, v_cache, meta, scale, num_req, 1, group_pad, None, launch)

    def _decode_launch(self, meta, heads: int, kv_heads: int, head_dim: int, device, balanced: bool) -> DecodeLaunch:
        return decode_launch(meta.num_requests * kv_heads, meta.max_seq_len, head_dim, device_num_sms(device),
                             self.config, balanced=balanced, group=heads // kv_heads)

    def prepare(self, meta: AttentionMetadata, shape: CallShape) -> AttentionMetadata:
        """The step's balanced split plan (the plan kernel's launch), made once for every
        layer's decode call: a step of ``L`` layers launched it ``L`` times, a few
        microseconds each (``docs/ARCHITECTURE.md``, "Paged decode attention"). Only
        pure-decode steps of several requests, where the call would balance."""
        if meta.max_query_len > 1 or meta.num_requests < 2:
            return meta
        launch = self._decode_launch(meta, shape.heads, shape.kv_heads, shape.head_dim, meta.seq_lens.device,
                                     balanced=True)
        if not launch.budget_splits:
            return meta
        plan = load_kernels().launch_split_plan(meta.seq_lens, launch.budget_splits, launch.num_splits,
                                                launch.block_n, shape.kv_heads)
        return self.with_prepared(meta, PreparedLaunch(self.name, self._plan_key(meta, launch, shape.kv_heads), plan))

    @staticmethod
    def _plan_key(meta, launch: DecodeLaunch, kv_heads: int):
        """The host ints a plan is made for (the merge counters are per KV head)."""
        return (meta.num_requests, launch.budget_splits, launch.num_splits, launch.block_n, kv_heads)

    def varlen(self, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        """Any query lengths: tiles of ``BLOCK_Q`` rows x the head group (:func:`prefill_tile`)."""
        num_kv_heads = k_cache.shape[2]
        group_pad = next_pow2(q.shape[1] // num_kv_heads)
        cfg = self.config
        rows, block_n, warps, stages = prefill_tile(q.shape[2], cfg)
        block_q = max(1, rows // group_pad)
        tile_req, tile_first, num_tiles = _tile_map(meta, q.shape[0], block_q)
        splits = choose_num_splits(num_tiles * num_kv_heads, meta.max_seq_len, device_num_sms(q.device), cfg)
        launch = DecodeLaunch(splits, block_n, warps, stages)
        tiles = (tile_req, tile_first)
        return self._run(q, k_cache, v_cache, meta, scale, num_tiles, block_q, group_pad, tiles, launch)

    def _run(self, q, k_cache, v_cache, meta, scale, num_tiles, block_q, group_pad, tiles, how: DecodeLaunch):
        kernels = load_kernels()
        splits = how.num_splits
        plan = None
        kv_heads = k_cache.shape[2]
        if how.budget_splits:  # the step's (prepare), else this call's: a plan kept across steps would go stale
            plan = meta.prepared_for(self.name, self._plan_key(meta, how, kv_heads))
            if plan is None:
                plan = kernels.launch_split_plan(meta.seq_lens, how.budget_splits, splits, how.block_n, kv_heads)
        out = torch.empty_like(q)
        launch = functools.partial(
            kernels.launch_paged_attention, q, k_cache, v_cache, meta=meta, scale=scale,
            num_tiles=num_tiles, num_splits=splits, block_q=block_q, group_pad=group_pad,
            block_n=how.block_n, num_warps=how.num_warps, num_stages=how.num_stages,
            tile_req=tiles[0] if tiles else None, tile_first=tiles[1] if tiles else None,
            upcast=interpreter_upcast(q.dtype), plan=plan,
        )
        if not how.partials:
            launch(out=out, lse=None)
            return out
        rows, num_heads, head_dim = q.shape
        part = torch.empty((rows, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((rows, num_heads, splits), dtype=torch.float32, device=q.device)
        if plan is not None and self.config.fused_merge and splits <= FUSED_MERGE_MAX_SLICES:
            # the last slice of each request and KV head merges the request's slices
            launch(out=part, lse=lse, merged=out)
            return out
        launch(out=part, lse=lse)
        split_tiles = None if plan is None else plan[0]
        kernels.launch_combine_splits(part, lse, out, splits, meta.seq_lens, split_tiles, how.block_n)
        return out


register_backend("triton", TritonPagedBackend, available=triton_importable, supports=triton_supports_device)
