"""The generator's speed model (openbook_generator/speed.py): shapes fitted once, a level that
follows the machine."""

from __future__ import annotations

import math

import pytest

from openbook_generator.speed import EngineSpeed, Line, fit_line


def test_fit_line_recovers_a_fixed_cost_and_a_cost_per_unit():
    line = fit_line([(1, 0.011), (8, 0.018), (128, 0.138)])
    assert line.fixed == pytest.approx(0.010, abs=1e-3)
    assert line.per_unit == pytest.approx(0.001, rel=0.05)


def test_fit_line_never_predicts_negative_or_free_work():
    line = fit_line([(10, 1.0), (20, 0.5)])  # noisy: more work measured faster
    assert line.per_unit >= 0 and line.fixed >= 0
    assert line.at(1) > 0
    through_origin = fit_line([(10, 0.1), (100, 2.0)])
    assert through_origin.fixed >= 0 and through_origin.at(50) > 0
    assert fit_line([(4, 2.0)]).at(4) == pytest.approx(2.0)


def _calibrated() -> EngineSpeed:
    speed = EngineSpeed()
    speed.calibrate([(100, 0.1), (1000, 1.0)], [(1, 0.02), (100, 0.12)])
    return speed


def test_a_machine_twice_as_slow_is_seen_within_seconds_for_every_size_of_work():
    speed = _calibrated()
    step, prefill, large = speed.step_s(10), speed.prefill_s(500), speed.step_s(100)
    assert step == pytest.approx(0.0291, rel=0.01) and large == pytest.approx(0.12)
    for _ in range(60):  # a neighbour took a core: every step of 10 rows takes twice as long
        speed.observe_step(10, 2 * step)  # (3.5 s of work)
    assert speed.step_s(10) == pytest.approx(2 * step, rel=0.1)
    # other batch sizes are predicted slower too, though none was measured
    assert speed.step_s(100) == pytest.approx(2 * large, rel=0.1)
    for _ in range(20):  # and prefill, once it is seen slower
        speed.observe_prefill(200, 2 * speed.prefill.at(200))
    assert speed.prefill_s(500) == pytest.approx(2 * prefill, rel=0.1)


def test_stalls_count_at_the_rate_work_gets_done():
    """Under a CPU quota most steps run at full speed and some wait out the throttling period:
    the estimate is the rate of work, not the typical step."""
    speed = _calibrated()
    step = speed.step_s(10)
    for i in range(400):  # every tenth step stalls for 0.25 s: 0.54 s per 10 steps, not 0.29
        speed.observe_step(10, step + (0.25 if i % 10 == 9 else 0.0))
    assert speed.step_s(10) == pytest.approx(step + 0.025, rel=0.15)


def test_a_pause_fades_within_seconds_of_work():
    speed = _calibrated()
    before = speed.step_s(10)
    speed.observe_step(10, 10.0)  # the process was paused once
    assert speed.step_s(10) > 5 * before
    for _ in range(350):  # 10 s of normal steps
        speed.observe_step(10, before)
    assert speed.step_s(10) < 1.1 * before


def test_work_of_a_millisecond_barely_moves_the_estimate():
    speed = EngineSpeed()
    speed.calibrate([(10, 0.0001), (1000, 0.01)], [(1, 0.0005), (8, 0.001)])
    before = speed.prefill_s(1000)
    for _ in range(5):  # interpreter overhead: tiny work measured 4x slower than its shape
        speed.observe_prefill(10, 4 * speed.prefill.at(10))
    assert speed.prefill_s(1000) < 1.01 * before


def test_steady_measurements_keep_the_estimate_still():
    speed = _calibrated()
    for i in range(1000):
        speed.observe_step(10, speed.step.at(10) * (1.1 if i % 2 else 1 / 1.1))
    assert speed.step_slowdown.factor == pytest.approx(1.0, abs=0.02)
    assert math.isfinite(speed.prefill_s(1000))


def test_unmeasured_speed_predicts_nothing_and_first_measurements_set_a_shape():
    speed = EngineSpeed()
    assert not speed.known and speed.step_s(8) == 0 and speed.prefill_s(100) == 0
    speed.observe_prefill(200, 0.4)
    speed.observe_step(4, 0.04)
    assert speed.known
    assert speed.prefill == Line(0.0, 0.002) and speed.prefill_s(100) == pytest.approx(0.2)


def test_lateness_scales_plans_up_when_requests_take_longer_than_planned_never_down():
    from openbook_generator.scheduler import Lateness

    lateness = Lateness()
    for _ in range(30):
        lateness.observe(planned_s=1.0, taken_s=1.5, time_left_s=3.0, now=0.0)
    assert lateness.factor == pytest.approx(1.5)
    for _ in range(60):  # faster than planned: no promise more
        lateness.observe(planned_s=1.0, taken_s=0.5, time_left_s=3.0, now=0.0)
    assert lateness.factor == 1.0


def test_lateness_plans_with_the_late_tail_not_the_average():
    """A crowd admitted up to its deadlines misses them on the requests that run late: one
    request in five taking twice its plan sets the factor, however many finish early."""
    from openbook_generator.scheduler import Lateness

    lateness = Lateness()
    for i in range(30):
        lateness.observe(
            planned_s=1.0, taken_s=2.0 if i % 5 == 0 else 0.8, time_left_s=3.0, now=0.0
        )
    assert lateness.factor == pytest.approx(2.0)


def test_lateness_ignores_plans_far_inside_their_deadline():
    """A plan of a few milliseconds against seconds of deadline cannot miss it; its ratio is a
    scheduler quantum, not a measure of how late admission's plans are."""
    from openbook_generator.scheduler import Lateness

    lateness = Lateness()
    for _ in range(30):
        lateness.observe(planned_s=0.01, taken_s=0.1, time_left_s=4.0, now=0.0)
    assert lateness.factor == 1.0


def test_an_idle_engine_relaxes_back_to_its_calibrated_speed():
    """One stalled step (a paused VM, a stopped process) must not make the generator refuse
    everything for good: with nothing admitted, nothing would ever measure it fast again."""
    from openbook_generator.speed import IDLE_WINDOW_S, Slowdown

    now = [1000.0]
    speed = _calibrated()
    speed.step_slowdown = Slowdown(clock=lambda: now[0])
    before = speed.step_s(10)
    now[0] += 60.0
    speed.observe_step(10, 60.0)  # one step took a minute
    assert speed.step_s(10) > 100 * before
    now[0] += 0.5 * IDLE_WINDOW_S  # idle: still cautious a little while after
    assert speed.step_s(10) > 10 * before
    now[0] += 10 * IDLE_WINDOW_S  # and back at the calibrated speed once idle a while
    assert speed.step_s(10) == pytest.approx(before, rel=0.05)


def test_busy_engines_do_not_relax():
    """Relaxing is for an engine with nothing measured: back-to-back work keeps its measure."""
    from openbook_generator.speed import Slowdown

    now = [0.0]
    speed = _calibrated()
    speed.step_slowdown = Slowdown(clock=lambda: now[0])
    step = speed.step_s(10)
    for _ in range(200):  # every step twice as slow, one after the other
        now[0] += 2 * step
        speed.observe_step(10, 2 * step)
    assert speed.step_s(10) == pytest.approx(2 * step, rel=0.05)


def test_scoring_has_its_own_slowdown_priced_from_the_prefill():
    speed = _calibrated()  # prefill: 1 ms per token
    assert speed.scoring_s(1000) == pytest.approx(1.0, rel=0.01)
    speed.observe_scoring(1000, 3.0)  # scoring 3x slower per token than prefilling
    assert speed.scoring_s(1000) == pytest.approx(3.0, rel=0.1)
    # neither the prefill nor the step is moved by it
    assert speed.prefill_s(1000) == pytest.approx(1.0, rel=0.01)
    assert speed.step_s(100) == pytest.approx(0.12, rel=0.01)
    assert EngineSpeed().scoring_s(1000) == 0.0  # nothing measured: nothing predicted
