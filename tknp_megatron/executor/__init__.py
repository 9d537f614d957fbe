"""One step over all layers on one rank: the executors and the pieces they drive.

``base.py`` is the contract every executor honours (``Executor``, ``StepOutput``);
``ingest.py`` admits requests on a rank (block tables, ingested KV) for every mode;
``tknp.py`` is the TKNP step (``dual_root.py`` its two-microbatch schedule), replayed
from ``cuda_graphs.py``; the step's device inputs come from ``step_inputs.py``;
``comm.py`` moves activations between roots and owners, ``dense.py`` runs the root's
Megatron submodules and ``owner_attention.py`` the owners' RoPE, KV write and attention.
See docs/ARCHITECTURE.md.
"""
