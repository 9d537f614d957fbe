"""Whether an N x T pool can serve a model: checked before any process starts.

Megatron's own modules assert these deep inside model construction (``divide`` of heads,
KV heads and MLP width by the TP size) and the placement needs a layer for every node; a
launcher checks them up front so a typo in a flag is one clear line, not a traceback from
every rank of a pool that has already started.
"""

from __future__ import annotations

from typing import List

from tknp_megatron.config import ModelPreset

__all__ = ["pool_problems"]


def pool_problems(preset: ModelPreset, nodes: int, tp: int, *, dual: bool = False) -> List[str]:
    """What stops ``nodes`` x TP ``tp`` from serving ``preset``, one line each, every line
    starting with the setting's name (``nodes`` or ``tp``) and its value; empty if nothing."""
    problems = []
    layers = preset.num_layers
    if nodes < 1:
        problems.append(f"nodes {nodes}: must be at least 1")
    elif nodes > layers:
        problems.append(f"nodes {nodes}: at most {layers}, the layers of {preset.name} "
                        "(every node stores a block of at least one layer)")
    elif dual and nodes % 2:
        problems.append(f"nodes {nodes}: two weight copies need an even node count")
    if tp < 1:
        problems.append(f"tp {tp}: must be at least 1")
        return problems
    for count, what in ((preset.num_attention_heads, "attention heads"),
                        (preset.num_query_groups, "KV heads"),
                        (preset.ffn_hidden_size, "MLP width")):
        if count % tp:
            problems.append(f"tp {tp}: must divide the {count} {what} of {preset.name}")
    return problems
