"""Baseline execution modes behind the same engine surface, scheduler and metrics as TKNP.

:mod:`.pp` is pipeline parallelism (stages pass microbatches on; the engine's step is one
tick of the microbatch cycle); :mod:`.dcp` is decode context parallelism (KV sharded
along the sequence, partial attention merged with log-sum-exp), as in vLLM. DP and TP
are pool layouts of the TKNP engine. Build any of them with
:func:`tknp_megatron.engine.factory.build_engine`.
"""
