"""The serving loop: requests in, tokens out.

``base.py`` is the surface every mode's engine shares (``InferenceEngine``: add_request,
step, generate, serve, shutdown, metrics), ``engine.py`` the lockstep step (one plan
broadcast to the pool) and the TKNP engine, ``factory.py`` builds an engine for any
:class:`~tknp_megatron.mode.Mode`; ``scheduler.py`` decides who runs and books what came
back, ``request.py`` is one request's whole lifecycle, ``intake.py`` checks requests
before they are queued and replays traces, ``kv_budget.py`` sizes the KV cache. See
docs/ARCHITECTURE.md.
"""
