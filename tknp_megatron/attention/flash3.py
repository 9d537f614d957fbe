"""The FlashAttention-3 backend ("fa3"): Hopper's FlashAttention over the paged cache, from
the compiled extension that vLLM's wheel ships (``vllm/vllm_flash_attn/_vllm_fa3_C*.so``).

Why this source: FlashAttention 3 has no wheel of its own on PyPI, flash-attn 2's paged
decode needs pages of 256 tokens, and flash-attn-4 has no split-K on Hopper
(``flash4.py``); vLLM builds FA3 with paged KV of any page size, split-K and packed GQA,
and its decode over pages is the one its engine runs (``docs/ARCHITECTURE.md``, "Kernels
per shape").
The extension needs only torch and the CUDA runtime, so it is loaded by path with
``torch.ops.load_library``, without importing vLLM (whose import initialises its own
platform and configuration): a folder holding just ``vllm/vllm_flash_attn/`` with the
library on ``PYTHONPATH`` serves as well as an installed vLLM. The library is built for
one torch and CUDA (vLLM 0.26.0: torch 2.11, CUDA 13); another torch fails to load it,
and the backend is then unavailable with the loader's reason (:func:`fa3_unavailable_reason`).

The op is called by its schema's argument names (``fwd(q, k, v, ..., page_table, ...)``),
so a build whose argument order differs still gets each tensor where it belongs, and one
that lacks a name is refused at load, not miscalled. One call serves decode and prefill:
the query rows as varlen ``cu_seqlens_q`` (this build runs varlen only), the cache lengths
as ``seqused_k``, the block table as ``page_table``, causal; ``num_splits=0`` is FA3's own
split-K count per shape, taken from the host ints of the call (the batch, the heads and
``max_seqlen_k``), so a CUDA graph replays the count it was captured with.

FA3 schedules each call's tiles over the requests' lengths with a small kernel of its own
before the attention kernel. That schedule is not made once per step for every layer (as
the Triton kernel's split plan is, ``AttentionBackend.prepare``): passing one
``get_scheduler_metadata`` result to several calls faulted on an H100 (an illegal memory
access at B = 128 x 4K, 64/8 heads, when calls on the shared schedule replayed between
calls that scheduled themselves; ``benchmarks/RESULTS.md``, eleventh session). The likely
cause: the schedule holds the persistent scheduler's tile counter, which FA3 resets in its
own scheduling kernel or in its split merge, so a shared schedule whose calls run one split
starts later calls from a used counter. Each call schedules itself.

At pages of 128 tokens or more FA3 loads a request's last page whole and weighs the slots
past its length by zero, so a NaN left there (by an earlier owner of the page) makes this
request's rows NaN; at 16- and 64-token pages it does not (measured on an H200). The
engine's cache starts zeroed; the ``auto`` backend (``per_shape.py``) takes FA3 only at
pages of up to 64 tokens.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Optional

import torch

from tknp_megatron.attention.base import AttentionBackend, AttentionMetadata, check_flash_inputs
from tknp_megatron.attention.registry import register_backend

__all__ = ["FlashAttn3Backend", "fa3_available", "fa3_library_path", "fa3_supports_device",
           "fa3_unavailable_reason", "fa3_usable"]

OP_NAMESPACE = "_vllm_fa3_C"
REQUIRED_ARGUMENTS = ("q", "k", "v", "out", "cu_seqlens_q", "seqused_k", "max_seqlen_q", "max_seqlen_k",
                      "page_table", "softmax_scale", "is_causal", "num_splits")


def fa3_library_path() -> Optional[Path]:
    """The FA3 extension inside the ``vllm`` package on the path (found, not imported),
    or None."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        found = sorted((Path(root) / "vllm_flash_attn").glob(f"{OP_NAMESPACE}*.so"))
        if found:
            return found[0]
    return None


def fa3_available() -> bool:
    """Whether the extension is there and loads in this process with a usable ``fwd``
    (loaded once; a process without it pays one search of the path)."""
    return fa3_library_path() is not None and fa3_unavailable_reason() is None


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
    """Load the extension once; None when its ``fwd`` is usable, else why not (one line)."""
    path = fa3_library_path()
    if path is None:
        return "no vllm/vllm_flash_attn/_vllm_fa3_C*.so on the Python path (vLLM's wheel ships it)"
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:  # built for another torch or CUDA
        cause = exc.__cause__ or exc  # torch wraps the loader's own message
        return f"{path} does not load here: {' '.join(str(cause).split())}"
    try:
        schema = getattr(torch.ops, OP_NAMESPACE).fwd.default._schema
    except (AttributeError, RuntimeError):
        return f"{path} registers no {OP_NAMESPACE}::fwd"
    names = {a.name for a in schema.arguments}
    missing = [n for n in REQUIRED_ARGUMENTS if n not in names]
    if missing:
        return f"{path}: {OP_NAMESPACE}::fwd has no argument {', '.join(missing)} (schema: {schema})"
    return None


def fa3_unavailable_reason() -> Optional[str]:
    """None when FA3 can be called in this process, else the reason (loads the library)."""
    return _load()


def fa3_supports_device(device: torch.device) -> bool:
    """CUDA devices of compute capability 9.x (FA3's kernels are Hopper's)."""
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


def fa3_usable(device: torch.device) -> bool:
    """Whether FA3 runs on ``device`` in this process (loads the library once)."""
    return fa3_supports_device(device) and fa3_available()


class FlashAttn3Backend(AttentionBackend):
    """Paged causal attention through FA3's ``fwd`` (see the module docstring).

    Args:
        num_splits: FA3's split-K count; 0 (default) is its own heuristic per shape.
        pack_gqa: whether FA3 packs a KV head's query heads into one tile; None (default)
            is its own choice per shape.
    """

    name = "fa3"

    def __init__(self, num_splits: int = 0, pack_gqa: Optional[bool] = None) -> None:
        why = fa3_unavailable_reason()
        if why is not None:
            raise RuntimeError(f"fa3 backend: {why}")
        if num_splits < 0:
            raise ValueError(f"num_splits {num_splits}: must be >= 0 (0: FA3's heuristic)")
        self._fwd = getattr(torch.ops, OP_NAMESPACE).fwd
        self.num_splits, self.pack_gqa = num_splits, pack_gqa
        names = {a.name for a in self._fwd.default._schema.arguments}
        # every other argument at its neutral value, where the build has it (vLLM's adds
        # attention sinks and context parallelism to FA3's own)
        neutral = dict(k_new=None, v_new=None, q_v=None, cu_seqlens_k=None, cu_seqlens_k_new=None,
                       seqused_q=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
                       seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None,
                       window_size_left=-1, window_size_right=-1, softcap=0.0, is_rotary_interleaved=True,
                       scheduler_metadata=None, pack_gqa=pack_gqa, sm_margin=0, s_aux=None,
                       cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None)
        self._fixed = {k: v for k, v in neutral.items() if k in names}

    def _forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        """``q [rows, Hq, d]``, caches ``[num_blocks, block_size, Hkv, d]`` -> ``[rows, Hq, d]``."""
        return self._call(q, k_cache, v_cache, meta, scale)[0]

    def forward_with_lse(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float):
        """The output and its log-sum-exp, for callers that merge partial attentions (DCP's
        shards): ``(out [rows, Hq, d] in q's dtype, lse [rows, Hq] fp32, natural log)``.
        A row that sees no token (an empty shard) gets ``out`` 0 and ``lse`` -inf, its weight 0
        in a merge (FA3 itself marks such rows with an infinite LSE)."""
        out, lse = self._call(q, k_cache, v_cache, meta, scale)[:2]
        lse = lse.transpose(0, 1)  # varlen: [Hq, rows] -> [rows, Hq]
        seen = torch.isfinite(lse)
        return out.masked_fill(~seen[..., None], 0.0), lse.masked_fill(~seen, float("-inf"))

    def _call(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        """FA3's ``fwd`` over the paged cache: ``[out [rows, Hq, d], softmax_lse [Hq, rows], ...]``."""
        check_flash_inputs("fa3", q)
        return self._fwd(
            q=q, k=k_cache, v=v_cache, out=None,
            cu_seqlens_q=meta.query_start_loc, seqused_k=meta.seq_lens,
            max_seqlen_q=max(meta.max_query_len, 1), max_seqlen_k=meta.max_seq_len,
            page_table=meta.block_table.contiguous(), softmax_scale=scale, is_causal=True,
            num_splits=self.num_splits, **self._fixed,
        )


register_backend("fa3", FlashAttn3Backend, available=fa3_available, supports=fa3_supports_device)
