"""The serving loop: requests in, tokens out.

``engine.py`` steps the pool (schedule, run, postprocess), ``scheduler.py`` decides who
runs and books what came back, ``request.py`` is one request's whole lifecycle,
``intake.py`` checks requests before they are queued and replays traces, ``kv_budget.py``
sizes the KV cache, ``factory.py`` builds an engine for any mode. See docs/ARCHITECTURE.md.
"""
