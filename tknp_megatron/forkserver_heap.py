"""Freeze a forkserver's heap before it forks: the last module a pool's forkserver preloads.

Importing this module collects garbage once and moves every object then alive (torch's,
Megatron-Core's, the preloaded modules') into the garbage collector's permanent generation
(``gc.freeze``). Every process forked from the server inherits that: its full collections
scan only what it allocated itself, not the hundreds of thousands of objects the imports
made (0.3-0.7 s per collection on a 2-core machine, paid by each rank at every engine build
and every ``parallel_state.destroy_model_parallel``), and the collector's writes leave the
server's pages shared instead of copying them into each rank (the use ``gc.freeze``'s own
documentation gives, for a process that forks workers).
"""

from tknp_megatron.engine.base import freeze_heap

freeze_heap()
