"""Observers: how an integration sees jobs deferred, claimed, run and settled.

Tracing (:mod:`aioq.contrib.otel`) and the test drain (:mod:`aioq.testing`) install one. The
core calls them at four points, each guarded by ``if hooks.observers:``, so with none installed
a point costs one truth test of an empty list. An observer that raises is logged and ignored,
except around the task's run and the defer, where its context manager wraps the real call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioq.job import Claim

__all__ = (
    "Deferral",
    "Observer",
    "claimed",
    "deferring",
    "install",
    "observers",
    "running",
    "settled",
    "uninstall",
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Deferral:
    """One call of ``defer`` (or ``defer_many``) as observers see it."""

    task: str
    queue: str
    count: int
    traceparent: str | None = None  # an observer sets it: stored with the jobs
    ids: Sequence[int] = ()  # the core sets it once the jobs are inserted


class Observer:
    """Base of an observer: override the points of interest; the others do nothing."""

    def deferring(self, deferral: Deferral) -> AbstractContextManager[object]:
        """Wrap the insert of a deferral's jobs; may set its ``traceparent``."""
        return nullcontext()

    def claimed(self, worker_id: str, claims: Sequence[Claim], start_ns: int, end_ns: int) -> None:
        """See the claims of one claim statement that ran from ``start_ns`` to ``end_ns``."""

    def running(self, worker_id: str, claim: Claim) -> AbstractContextManager[object]:
        """Wrap one run of a task (inside its job context; exceptions pass through it)."""
        return nullcontext()

    def settled(
        self,
        worker_id: str,
        outcome: str,
        settled: Sequence[tuple[Claim, str | None]],
        start_ns: int,
        end_ns: int,
    ) -> None:
        """See (claim, error) of attempts whose ``outcome`` one statement wrote, still fenced."""


observers: list[Observer] = []
"""The installed observers, in installation order."""


def install(observer: Observer) -> None:
    """Add an observer (once); remove it with ``uninstall``."""
    if observer not in observers:
        observers.append(observer)


def uninstall(observer: Observer) -> None:
    """Remove an observer if it is installed."""
    if observer in observers:
        observers.remove(observer)


def deferring(deferral: Deferral) -> AbstractContextManager[object]:
    """Return every observer's ``deferring`` as one context manager around an insert."""
    if len(observers) == 1:  # the usual case, without an ExitStack's cost
        return observers[0].deferring(deferral)
    return _all([observer.deferring(deferral) for observer in observers])


def running(worker_id: str, claim: Claim) -> AbstractContextManager[object]:
    """Return every observer's ``running`` as one context manager around a task's run."""
    if len(observers) == 1:
        return observers[0].running(worker_id, claim)
    return _all([observer.running(worker_id, claim) for observer in observers])


@contextmanager
def _all(managers: Iterable[AbstractContextManager[object]]) -> Iterator[None]:
    with ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def claimed(worker_id: str, claims: Sequence[Claim], start_ns: int, end_ns: int) -> None:
    """Tell every observer about the claims of one statement."""
    for observer in tuple(observers):
        try:
            observer.claimed(worker_id, claims, start_ns, end_ns)
        except Exception:
            logger.exception("observer %r failed on claimed jobs", observer)


def settled(
    worker_id: str,
    outcome: str,
    settled: Sequence[tuple[Claim, str | None]],
    start_ns: int,
    end_ns: int,
) -> None:
    """Tell every observer about outcomes one statement wrote."""
    for observer in tuple(observers):
        try:
            observer.settled(worker_id, outcome, settled, start_ns, end_ns)
        except Exception:
            logger.exception("observer %r failed on settled jobs", observer)
