"""Run N worker processes: forward stop signals, restart crashed children with backoff.

``aioq worker --processes N`` runs this in the parent. Each child is a full
``python -m aioq worker ... --processes 1`` in its own process group, so a terminal's Ctrl-C
reaches only the supervisor, which forwards it once per signal: the first signal stops the
children gracefully, a second one makes them cancel their jobs at once. A child that exits
non-zero or is killed by a signal is restarted after a capped exponential backoff, unless a
stop signal has arrived; a child that exits 0 on its own is not replaced.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType

from aioq.backoff import Backoff

__all__ = ("Supervisor",)

logger = logging.getLogger(__name__)

DEFAULT_BACKOFF = 0.5
DEFAULT_BACKOFF_CAP = 30.0
# A child that ran this long before crashing starts its backoff afresh.
DEFAULT_STABLE_AFTER = 30.0
_TICK = 0.1
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


PROCESS_INDEX_ENV = "AIOQ_PROCESS_INDEX"


@dataclass(slots=True)
class _Slot:
    """One child position: the process in it, its crash streak, when to restart it."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    failures: int = 0
    restart_at: float | None = None
    returncode: int | None = None
    done: bool = False


@dataclass(slots=True)
class Supervisor:
    """Keep ``processes`` copies of ``command`` running until SIGTERM or SIGINT."""

    command: Sequence[str]
    processes: int
    env: Mapping[str, str] | None = None
    backoff: float = DEFAULT_BACKOFF
    backoff_cap: float = DEFAULT_BACKOFF_CAP
    stable_after: float = DEFAULT_STABLE_AFTER
    _signals: list[int] = field(default_factory=list)
    _stopping: bool = False

    def run(self) -> int:
        """Supervise until every child has exited after a stop signal; 0 if all exited 0."""
        if self.processes < 1:
            raise ValueError(f"processes must be >= 1, got {self.processes}")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _STOP_SIGNALS}
        slots = [_Slot(i) for i in range(self.processes)]
        try:
            for slot in slots:
                self._start(slot)
            while not all(slot.done for slot in slots):
                self._forward(slots)
                now = time.monotonic()
                for slot in slots:
                    self._check(slot, now)
                time.sleep(_TICK)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        failed = [s for s in slots if s.returncode != 0]
        for slot in failed:
            logger.warning("child %d ended with status %s", slot.index, slot.returncode)
        return 1 if failed else 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _forward(self, slots: list[_Slot]) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if not self._stopping:
                logger.info(
                    "received %s: stopping %d children", signal.Signals(signum).name, len(slots)
                )
            self._stopping = True
            for slot in slots:
                if slot.proc is not None and slot.proc.poll() is None:
                    slot.proc.send_signal(signum)

    def _start(self, slot: _Slot) -> None:
        env = dict(self.env if self.env is not None else os.environ)
        env[PROCESS_INDEX_ENV] = str(slot.index)  # e.g. to give each child its own metrics port
        # The child starts with the stop signals blocked (the mask survives exec) and unblocks
        # them once its handler is in place: a stop that arrives while it is still importing
        # waits for the handler instead of killing it by the default action.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            slot.proc = subprocess.Popen(
                list(self.command),
                env=env,
                process_group=0,  # keep the terminal's Ctrl-C away: we forward signals ourselves
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        slot.started = time.monotonic()
        slot.restart_at = None
        logger.info("started child %d (pid %d)", slot.index, slot.proc.pid)

    def _check(self, slot: _Slot, now: float) -> None:
        if slot.done:
            return
        if slot.proc is None:  # waiting out a backoff
            if self._stopping:
                slot.done = True
            elif slot.restart_at is not None and now >= slot.restart_at:
                self._start(slot)
            return
        code = slot.proc.poll()
        if code is None:
            return
        pid, slot.proc, slot.returncode = slot.proc.pid, None, code
        if self._stopping or code == 0:
            logger.info("child %d (pid %d) exited with status %d", slot.index, pid, code)
            slot.done = True
            return
        if now - slot.started >= self.stable_after:
            slot.failures = 0
        slot.failures += 1
        delay = Backoff(base=self.backoff, max=self.backoff_cap, jitter=0).delay(slot.failures)
        slot.restart_at = now + delay
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        logger.warning("child %d (pid %d) %s; restarting it in %.1fs", slot.index, pid, how, delay)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
