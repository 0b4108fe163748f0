"""The step loop's bookkeeping: a step in flight (``Launched``) and the clocks that say
where a step's time goes (``StepClock``): host work, the wait for the device, and the
host work the device waited for (the critical path).

Host only (no jax calls beyond ``is_ready`` on a handle).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class Launched:
    """One replica's step, dispatched and not yet resolved: what the scheduler gave it, the
    batch it ran as, the device handle of its packed sampler output (and of a scoring
    bucket's prompt scores), and, once fetched, the packed output on the host."""

    rep: Any                  # engine.replica.Replica
    sched: Any                # scheduler.SchedulerOutput
    batch: Any                # batch.StepBatch
    handle: Any               # jax.Array i32[S', 2 + 2K]
    scores: Any = None        # jax.Array i32[T, 2 + 2K] of a scoring bucket, else None
    packed: Any = None        # np.ndarray, after the fetch
    committed: bool = False   # Scheduler.commit ran at dispatch (the overlapped loop)

    def is_ready(self) -> bool:
        ready = getattr(self.handle, "is_ready", None)
        return True if ready is None else bool(ready())


class StepClock:
    """Seconds of the engine's steps, summed over its life.

    * ``host``: wall time of ``Engine.step`` calls less the time blocked fetching results;
    * ``device``: the time blocked fetching (the device still running what the host waits
      for);
    * ``critical``: host work the device had nothing queued for. The host cannot see the
      device go idle, so this is an upper bound: within a call, the host work before a
      dispatch counts when every step in flight has finished by then (or none is in
      flight), and the work after the call's last fetch counts when that is so at the
      call's end. In the synchronous loop that is all its host work; in the overlapped
      loop, only what the device outran. Time between calls (an idle engine) is nobody's.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.host = self.device = self.critical = self.wall = 0.0
        self._mark = 0.0                 # since when the host works, the device maybe idle

    @staticmethod
    def _device_busy(in_flight: list[list[Launched]]) -> bool:
        return any(not f.is_ready() for group in in_flight for f in group)

    def before_dispatch(self, in_flight: list[list[Launched]]) -> None:
        now = time.perf_counter()
        if not self._device_busy(in_flight):
            self.critical += now - self._mark
        self._mark = now                 # from the dispatch on, the device has work

    @contextlib.contextmanager
    def waiting(self, call: "CallTimer") -> Iterator[None]:
        """A blocking fetch: its time is the device's."""
        t = time.perf_counter()
        yield
        self._mark = time.perf_counter()
        call.device += self._mark - t

    @contextlib.contextmanager
    def call(self, in_flight: list[list[Launched]]) -> Iterator["CallTimer"]:
        """One ``Engine.step`` call (``in_flight``: the engine's list, read at the end);
        counted when it dispatched or resolved a step."""
        timer = CallTimer(time.perf_counter())
        self._mark = timer.t0
        yield timer
        if timer.steps or timer.dispatched:
            end = time.perf_counter()
            if not self._device_busy(in_flight):
                self.critical += end - self._mark
            wall = end - timer.t0
            self.steps += timer.steps
            self.wall += wall
            self.device += timer.device
            self.host += wall - timer.device

    def stats(self) -> dict[str, float]:
        """Per step: host work, the host work on the critical path, the device's share of
        the wall time, and the fraction of host work the device overlapped."""
        n = max(1, self.steps)
        critical = min(self.critical, self.host)
        return {"host_ms_per_step": self.host / n * 1e3,
                "critical_host_ms_per_step": critical / n * 1e3,
                "device_ms_per_step": max(0.0, self.wall - critical) / n * 1e3,
                "overlapped_fraction": 1.0 - critical / self.host if self.host > 0 else 0.0}


@dataclass
class CallTimer:
    """One ``Engine.step`` call: when it began, the seconds it blocked on the device and
    the model steps it resolved (a multi-step run resolves k), and whether it dispatched one."""

    t0: float
    device: float = 0.0
    steps: int = 0
    dispatched: bool = False
