"""Serving a TKNP pool behind Megatron-Core's own inference server.

- :mod:`~tknp_megatron.serving.megatron_types`: Megatron's sampling parameters in, its
  request records out (the installed version's own classes and serialization);
- :mod:`~tknp_megatron.serving.coordinator_link`: the engine side of Megatron's
  coordinator protocol, one per pool;
- :mod:`~tknp_megatron.serving.pool_server`: the long-running engine loop of a pool;
- :mod:`~tknp_megatron.serving.frontend`: Megatron's coordinator and HTTP server on rank 0.

``examples/serve_tknp.py`` puts them together.
"""
