"""The serving loop's host-work record: the mean includes admission steps, the median is a
decode step's."""

from tknp_megatron.profiler import LoopTiming


def test_median_ignores_the_admission_steps():
    timing = LoopTiming()
    assert timing.host_median_ms() == 0.0 and timing.per_step_ms() == (0.0, 0.0)
    timing.add(0.5, 0.01)  # a step that ingests prompts' KV
    for _ in range(9):
        timing.add(0.002, 0.010)
    host, wait = timing.per_step_ms()
    assert abs(host - 51.8) < 1e-9 and abs(wait - 10.0) < 1e-9
    assert abs(timing.host_median_ms() - 2.0) < 1e-9
    timing.clear()
    assert timing.steps == 0 and timing.host_median_ms() == 0.0


def test_the_record_is_bounded():
    from tknp_megatron.profiler import HOST_STEPS_KEPT

    timing = LoopTiming()
    for i in range(HOST_STEPS_KEPT + 10):
        timing.add(1.0 if i < 10 else 0.001)
    assert len(timing.host_steps) == HOST_STEPS_KEPT and timing.steps == HOST_STEPS_KEPT + 10
    assert abs(timing.host_median_ms() - 1.0) < 1e-9  # the 10 oldest (1 s) steps are gone
