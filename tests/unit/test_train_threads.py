"""num_threads: auto: the tuner probes 1 and 2 threads and keeps the faster."""

from __future__ import annotations

from stages.train.threads import ThreadTuner


def drive(tuner: ThreadTuner, steps: int, seconds: dict[int, float]) -> list[int]:
    """Run `steps` steps of 100 tokens; each takes `seconds[threads]`."""
    used = []
    for k in range(steps):
        n = tuner.threads_for(k)
        tuner.record(k, 100, seconds[n])
        used.append(n)
    return used


def test_two_threads_win_when_faster_and_are_rechecked_every_interval():
    tuner = ThreadTuner(2, window=3, every=10)
    used = drive(tuner, 17, {1: 0.2, 2: 0.1})
    # probe: 3 steps with 1 thread, 3 with 2; then 2 threads until step 16 (5 + 1 + 10)
    assert used == [1, 1, 1, 2, 2, 2] + [2] * 10 + [1]
    assert tuner.best == 2
    assert tuner.interval == 10


def test_a_much_slower_count_is_dropped_after_one_step_and_probed_less_often():
    tuner = ThreadTuner(2, window=3, every=10)
    used = drive(tuner, 28, {1: 0.1, 2: 2.0})
    # 2 threads at 1/20 the rate: one step, then 1 thread; next probe after 20, then 40 steps
    assert used == [1, 1, 1, 2] + [1] * 20 + [1, 1, 1, 2]
    assert tuner.best == 1
    assert tuner.interval == 40


def test_one_core_never_probes():
    tuner = ThreadTuner(1, window=3, every=10)
    assert drive(tuner, 12, {1: 1.0}) == [1] * 12
