"""Observers: how an integration sees jobs deferred, claimed, run and settled.

Tracing (:mod:`aioq.contrib.otel`) and the test drain (:mod:`aioq.testing`) install one. The
core calls them at four points, each guarded by ``if hooks.observers:``, so with none installed
a point costs one truth test of an empty list. An observer that raises is logged and ignored,
except around the task's run and the defer, where its context manager wraps the real call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from aioq.job import Claim

__all__ = (
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


class Observer:
    """Base of an observer: override the points of interest; the others do nothing."""

    def deferring(self, task: str, queue: str, count: int) -> AbstractContextManager[str | None]:
        """Wrap the insert of ``count`` jobs; yield a W3C traceparent to store with them."""
        return nullcontext()

    def claimed(self, worker_id: str, claims: Sequence[Claim], start_ns: int, end_ns: int) -> None:
        """See the claims of one claim statement that ran from ``start_ns`` to ``end_ns``."""

    def running(self, worker_id: str, claim: Claim) -> AbstractContextManager[None]:
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


@contextmanager
def deferring(task: str, queue: str, count: int) -> Iterator[str | None]:
    """Enter every observer's ``deferring``; yield the first traceparent one gives."""
    with ExitStack() as stack:
        traceparent = None
        for observer in tuple(observers):
            given = stack.enter_context(observer.deferring(task, queue, count))
            traceparent = traceparent or given
        yield traceparent


@contextmanager
def running(worker_id: str, claim: Claim) -> Iterator[None]:
    """Enter every observer's ``running`` around one run of a task."""
    with ExitStack() as stack:
        for observer in tuple(observers):
            stack.enter_context(observer.running(worker_id, claim))
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
