"""Baseline execution modes run by the same engine, scheduler and metrics as TKNP.

:mod:`.dcp` is decode context parallelism (KV sharded along the sequence, partial
attention merged with log-sum-exp), as in vLLM.
"""
