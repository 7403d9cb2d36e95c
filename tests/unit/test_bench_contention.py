"""The bench's contention guard: others' CPU from two /proc/stat snapshots minus our own
process tree's CPU time, the contended decision, the bounded wait for a quiet machine."""

from __future__ import annotations

import os

import pytest

from colocate.bench.contention import (GuardOptions, Load, Snapshot, contended, guarded, others_load,
                                       parse_proc_stat, snapshot, tree_cpu_seconds, wait_for_quiet)

STAT = """cpu  1000 10 200 5000 40 0 6 4 0 0
cpu0 600 10 100 2000 20 0 3 2 0 0
cpu1 400 0 100 3000 20 0 3 2 0 0
intr 309166 0 0
ctxt 326167
"""


def test_busy_time_is_user_nice_system_irq_softirq_steal_not_idle_or_iowait():
    assert parse_proc_stat(STAT, None, hz=100) == pytest.approx((1000 + 10 + 200 + 0 + 6 + 4) / 100)
    assert parse_proc_stat(STAT, frozenset({0}), hz=100) == pytest.approx((600 + 10 + 100 + 3 + 2) / 100)
    assert parse_proc_stat(STAT, frozenset({0, 1}), hz=100) == pytest.approx(12.2)  # the sum of the cpuN lines
    assert parse_proc_stat(STAT, frozenset({7}), hz=100) == pytest.approx(12.2)  # absent cpus: the aggregate line
    with pytest.raises(ValueError):
        parse_proc_stat("intr 1 2\n")


def test_others_are_machine_busy_minus_our_tree_over_wall_time():
    before = Snapshot(wall=10.0, busy_s=100.0, own_s=50.0)
    after = Snapshot(wall=14.0, busy_s=108.0, own_s=57.0)  # 8 s busy, 7 of them ours, in 4 s
    load = others_load(before, after)
    assert load.wall_s == 4.0 and load.others_cpu_s == pytest.approx(1.0)
    assert load.others_cores == pytest.approx(0.25)
    assert not contended(load, 0.25) and contended(load, 0.2)
    # tick rounding can put our share a little above the machine's: never a negative load
    assert others_load(before, Snapshot(14.0, 107.99, 58.0)).others_cpu_s == 0.0
    assert Load(0.0, 1.0).others_cores == 0.0


def test_a_busy_neighbour_reads_as_others_and_our_own_work_does_not():
    ours = [Snapshot(0.0, 0.0, 0.0), Snapshot(2.0, 4.0, 3.9)]  # both cores busy, almost all of it us
    theirs = [Snapshot(0.0, 0.0, 0.0), Snapshot(2.0, 4.0, 2.0)]  # both cores busy, half of it someone else
    assert others_load(*ours).others_cores == pytest.approx(0.05)
    assert others_load(*theirs).others_cores == pytest.approx(1.0)


def _reader(loads: list[float], window: float = 0.2):
    """Snapshots whose consecutive pairs show the given others' loads (cores) per window."""
    snaps, t, busy = [], 0.0, 0.0
    for cores in loads:
        snaps += [Snapshot(t, busy, 0.0), Snapshot(t + window, busy + cores * window, 0.0)]
        t, busy = t + window, busy + cores * window
    it = iter(snaps)
    return lambda: next(it)


def test_waiting_for_a_quiet_machine_stops_at_the_first_quiet_window_or_the_bound():
    opts = GuardOptions(limit_cores=0.25, quiet_wait_s=1.0, window_s=0.2)
    assert wait_for_quiet(opts, _reader([1.0, 0.9, 0.1, 1.0]), sleep=lambda s: None) == pytest.approx(0.6)
    assert wait_for_quiet(opts, _reader([0.0]), sleep=lambda s: None) == pytest.approx(0.2)
    assert wait_for_quiet(opts, _reader([2.0] * 10), sleep=lambda s: None) == pytest.approx(1.0)  # bounded
    assert wait_for_quiet(GuardOptions(quiet_wait_s=0), lambda: pytest.fail("read"), sleep=pytest.fail) == 0.0


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc")
def test_real_counters_and_a_guarded_call():
    first = snapshot()
    assert first.busy_s > 0 and first.own_s > 0 and tree_cpu_seconds() >= first.own_s
    result, load = guarded(lambda: sum(range(200_000)), GuardOptions(quiet_wait_s=0))
    assert result == sum(range(200_000))
    assert set(load) == {"others_cores", "others_cpu_s", "quiet_wait_s", "contended"}
    assert load["others_cores"] >= 0 and load["quiet_wait_s"] == 0
    assert guarded(lambda: 7, None) == (7, {})
