"""How busy the CPUs are with other programs, so that an engine's thread count fits what is free.

With as many threads as cores, every OpenMP barrier of a prompt pass waits for the thread another
program has descheduled: with one of two cores taken by another job, the demo's 42-token prefill took
3.1 s on 2 threads against 0.21 s on 1, and decode fell from 19-20 to 12-16 tok/s. The probe reads the
busy time of the CPUs this process may use (/proc/stat) at two moments, around the model load so that
it costs nothing, and subtracts this process's own CPU time in between: what is left is the load of
other programs, in cores. Linux only; elsewhere nothing is measured and the default stands.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

MIN_INTERVAL_S = 0.1  # /proc/stat counts in 10 ms ticks: a shorter probe is mostly rounding
SPARE = 0.3  # a thread is worth starting on a core at least 70% free


@dataclass(frozen=True)
class CpuSnapshot:
    wall_s: float  # time.monotonic()
    busy_s: float  # busy time of this process's CPUs since boot, every program's (seconds of CPU)
    own_s: float  # this process's CPU time so far, all its threads


@dataclass(frozen=True)
class CpuLoad:
    """What other programs used of this process's CPUs during a probe."""

    cores: int  # CPUs this process may run on
    others_busy: float  # cores' worth of time other programs used (0 .. cores)

    @property
    def free_cores(self) -> float:
        return max(0.0, self.cores - self.others_busy)

    @property
    def is_busy(self) -> bool:
        """Whether other programs hold enough of a core that a thread fewer is the better choice."""
        return math.floor(self.free_cores + SPARE) < self.cores

    def threads_for(self, default: int) -> int:
        """`default` threads, fewer when other programs leave less than that many cores free (at least 1)."""
        return max(1, min(default, math.floor(self.free_cores + SPARE)))

    def describe(self) -> str:
        return f"{self.others_busy:.1f} of {self.cores} cores busy with other programs"


def _usable_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def snapshot() -> CpuSnapshot | None:
    """The busy time of this process's CPUs and its own CPU time, now; None where /proc/stat is unreadable."""
    cpus = _usable_cpus()
    busy_ticks = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
                    continue
                # user nice system idle iowait irq softirq steal: all but idle and iowait keep the CPU from us
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
                busy_ticks += user + nice + system + irq + softirq + steal
    except (OSError, ValueError):
        return None
    own = os.times()
    return CpuSnapshot(time.monotonic(), busy_ticks / os.sysconf("SC_CLK_TCK"), own.user + own.system)


def measure(since: CpuSnapshot | None) -> CpuLoad | None:
    """Other programs' load on this process's CPUs from `since` to now (waiting out MIN_INTERVAL_S)."""
    if since is None:
        return None
    wait = MIN_INTERVAL_S - (time.monotonic() - since.wall_s)
    if wait > 0:
        time.sleep(wait)
    now = snapshot()
    if now is None:
        return None
    cores = len(_usable_cpus())
    elapsed = now.wall_s - since.wall_s
    others = ((now.busy_s - since.busy_s) - (now.own_s - since.own_s)) / elapsed
    return CpuLoad(cores=cores, others_busy=min(float(cores), max(0.0, others)))
