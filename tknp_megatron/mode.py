"""The decode pool's parallel modes, one enum for every tool that names them.

The engine factory builds a mode, ``analysis.serving`` replays traces over it, the cost
model sizes its KV capacity and the benchmarks' CLIs take its value as a choice. Values
are the CLI / JSON spellings (``tknp-dual``); :attr:`Mode.field` is the identifier
spelling (``tknp_dual``) that the capacity model's fields and report keys use.
"""

from __future__ import annotations

import enum
from typing import Tuple

__all__ = ["Mode"]


class Mode(str, enum.Enum):
    """How a world of W ranks (T per node) serves decode.

    DP: W / T independent pools of one node x TP T; requests round-robin.
    TP: one pool, one node, TP over all W ranks.
    PP: W / T pipeline stages x TP T, about W / T microbatches in flight.
    DCP: one pool, TP over all W ranks, KV sharded by sequence (needs W > KV heads).
    TKNP: one TKNP pool, N = W / T nodes x TP T.
    TKNP_DUAL: TKNP with dual-active-root microbatching (two weight copies, N even).
    """

    DP = "dp"
    TP = "tp"
    PP = "pp"
    DCP = "dcp"
    TKNP = "tknp"
    TKNP_DUAL = "tknp-dual"

    @classmethod
    def _missing_(cls, value):
        """Also accept the identifier spelling (``Mode("tknp_dual")``)."""
        if isinstance(value, str):
            for mode in cls:
                if mode.field == value:
                    return mode
        return None

    @property
    def field(self) -> str:
        """The identifier spelling: ``tknp_dual`` for ``tknp-dual``, else the value."""
        return self.value.replace("-", "_")

    def pool_shape(self, world: int, tp: int) -> Tuple[int, int, int]:
        """``(num_pools, nodes per pool, TP ranks per node)`` of this mode on ``world``
        ranks, ``tp`` per node for the modes that keep TP inside a node."""
        if self in (Mode.TKNP, Mode.TKNP_DUAL, Mode.PP):
            return 1, world // tp, tp
        if self is Mode.DP:
            return world // tp, 1, tp
        return 1, 1, world
