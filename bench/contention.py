"""The bench guarding its own numbers: how much CPU other processes took during a step.

On a 2-core machine a busy neighbour can make a step read several times slower, and a
ratio between two modes then measures the neighbour. Per measured step this module
records the CPU time the rest of the machine used: the busy time of our CPUs in
``/proc/stat`` minus the CPU time of our own process tree (psutil: this process, every
descendant, and the reaped ones through their parents' ``children_*`` times, so the
engines' scheduler processes and the feeder count as ours), divided by the step's wall
time: ``others_cores`` (0.5 = half a core busy with something else on average).

Owns: reading the two counters (``snapshot``), the pure arithmetic over two snapshots
(``others_load``, ``parse_proc_stat``), the contended/quiet decision, and a bounded wait
for a quiet machine before a step (``wait_for_quiet``). Busy time is user + nice + system
+ irq + softirq + steal (steal: a hypervisor ran someone else on our vCPU); idle and
iowait are not busy; guest times are already inside user/nice.
Leaves out: what is done with contended steps (``bench.report`` excludes them from medians).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system [idle iowait] irq softirq steal
DEFAULT_LIMIT = 0.25  # cores: above this on average, a step is contended


@dataclasses.dataclass(frozen=True)
class GuardOptions:
    limit_cores: float = DEFAULT_LIMIT  # a step whose others_cores exceeds this is contended
    quiet_wait_s: float = 10.0  # wait at most this long for a quiet machine before a step (0: never)
    window_s: float = 0.2  # sampling window of that wait


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One reading of the machine's busy CPU seconds and our own tree's CPU seconds."""

    wall: float
    busy_s: float
    own_s: float


@dataclasses.dataclass(frozen=True)
class Load:
    """What others used between two snapshots."""

    wall_s: float
    others_cpu_s: float

    @property
    def others_cores(self) -> float:
        return self.others_cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def parse_proc_stat(text: str, cpus: frozenset[int] | None = None, hz: int = 100) -> float:
    """Busy seconds in ``/proc/stat`` text: of the ``cpuN`` lines in ``cpus``, or of the
    aggregate ``cpu`` line when ``cpus`` is None (or none of its lines is present)."""
    total_line, per_cpu = None, 0
    found = False
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu"):
            continue
        ticks = [int(x) for x in rest.split()]
        busy = sum(ticks[i] for i in BUSY_FIELDS if i < len(ticks))
        if name == "cpu":
            total_line = busy
        elif cpus is not None and int(name[3:]) in cpus:
            per_cpu, found = per_cpu + busy, True
    ticks = per_cpu if found else total_line
    if ticks is None:
        raise ValueError("no cpu line in /proc/stat text")
    return ticks / hz


def others_load(before: Snapshot, after: Snapshot) -> Load:
    """CPU seconds the rest of the machine used between two snapshots (never below 0:
    tick rounding can make our own share read a little above the machine's)."""
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return Load(wall_s=after.wall - before.wall, others_cpu_s=max(0.0, others))


def contended(load: Load, limit_cores: float) -> bool:
    return load.others_cores > limit_cores


def tree_cpu_seconds(pid: int | None = None) -> float:
    """user + system CPU seconds of process ``pid`` (default: this one) and all its
    descendants, live ones directly and reaped ones through their parents' children times."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # it ended between the listing and the read: its time is lost to "others"
        total += t.user + t.system + t.children_user + t.children_system
    return total


def snapshot(cpus: frozenset[int] | None = None) -> Snapshot:
    """Read both counters now; ``cpus`` defaults to this process's CPU affinity."""
    if cpus is None and hasattr(os, "sched_getaffinity"):
        cpus = frozenset(os.sched_getaffinity(0))
    with open("/proc/stat") as f:
        busy = parse_proc_stat(f.read(), cpus, os.sysconf("SC_CLK_TCK"))
    return Snapshot(wall=time.perf_counter(), busy_s=busy, own_s=tree_cpu_seconds())


def available() -> bool:
    """Whether this machine has the counters (Linux /proc with psutil)."""
    try:
        snapshot()
    except (OSError, ImportError, ValueError):
        return False
    return True


def wait_for_quiet(opts: GuardOptions, read: Callable[[], Snapshot] = snapshot,
                   sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait, in windows of ``opts.window_s``, until a window's others load is at most
    ``opts.limit_cores`` or ``opts.quiet_wait_s`` has passed; returns the seconds waited."""
    if opts.quiet_wait_s <= 0:
        return 0.0
    waited = 0.0
    while waited < opts.quiet_wait_s:
        before = read()
        sleep(opts.window_s)
        load = others_load(before, read())
        waited += load.wall_s
        if not contended(load, opts.limit_cores):
            break
    return waited


def guarded(call: Callable[[], object], opts: GuardOptions | None) -> tuple[object, dict[str, float | bool]]:
    """``call()`` after an optional wait for a quiet machine, with the others load during
    it: (result, {"others_cores", "others_cpu_s", "quiet_wait_s", "contended"}). Without
    ``opts`` (or the counters) the call runs bare and the fields are empty."""
    if opts is None:
        return call(), {}
    waited = wait_for_quiet(opts)
    before = snapshot()
    result = call()
    load = others_load(before, snapshot())
    return result, {"others_cores": load.others_cores, "others_cpu_s": load.others_cpu_s,
                    "quiet_wait_s": waited, "contended": contended(load, opts.limit_cores)}
