"""The admin functions a synchronous caller needs: a job, its cancel, its result.

Each runs the async form's statements on a synchronous connection (:mod:`aioq.dbapi`) and
makes the same decisions with the same helpers, so both forms answer alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from aioq import queries
from aioq.admin import CANCEL_RACES, cancel_outcome, settle_cancels
from aioq.codec import decode_result
from aioq.dbapi import SyncTarget, executor, row, rows
from aioq.errors import ConfigError, ResultTimeout
from aioq.job import Job
from aioq.queries import DEFAULT_SCHEMA
from aioq.results import DEFAULT_RESULT_TIMEOUT, _judge
from aioq.sql import Statement

__all__ = ("cancel_jobs_sync", "get_job_sync", "result_sync")


# The admin statements the synchronous functions run (the async side's, in aioq/queries.py).
_GET_JOB = Statement(queries.GET_JOB, Job.from_row)
_GET_ARCHIVED_JOB = Statement(queries.GET_ARCHIVED_JOB, Job.from_row)
_CANCEL_JOBS = Statement(queries.CANCEL_JOBS, lambda r: (int(r[0]), str(r[1])))
_RESULT_STATE = Statement(queries.RESULT_STATE, lambda r: r)

_FIRST_POLL = 0.05  # seconds; then doubling, up to:
_MAX_POLL = 1.0


def get_job_sync(conn: SyncTarget, job_id: int, *, schema: str = DEFAULT_SCHEMA) -> Job | None:
    """Return a job, as :func:`aioq.get_job` does, from synchronous code."""
    db = executor(conn)
    found = row(_GET_JOB, db, schema, job_id)
    return found if found is not None else row(_GET_ARCHIVED_JOB, db, schema, job_id)


def cancel_jobs_sync(
    conn: SyncTarget, job_ids: Sequence[int], *, schema: str = DEFAULT_SCHEMA
) -> dict[int, str]:
    """Cancel jobs wherever they are, as :func:`aioq.cancel_jobs` does, from synchronous code."""
    db = executor(conn)
    ids = sorted({int(i) for i in job_ids})
    channels = (queries.control_channel(schema), queries.results_channel(schema))
    states: dict[int, str] = {}
    for _ in range(CANCEL_RACES):
        if not ids:
            break
        ids = settle_cancels(states, dict(rows(_CANCEL_JOBS, db, schema, ids, *channels)))
    return cancel_outcome(states, ids)


def result_sync(
    conn: SyncTarget,
    job_id: int,
    *,
    timeout: float | None = DEFAULT_RESULT_TIMEOUT,
    schema: str = DEFAULT_SCHEMA,
) -> Any:
    """Wait for a job to end and return its value, as :func:`aioq.result` does (it raises the
    same errors), from synchronous code.

    It polls the job's state, every 50 ms at first and at most every second: each poll is one
    short read. On a connection in a transaction, every poll runs in that transaction (at
    READ COMMITTED each sees the latest commits); outside one, each commits on its own.
    """
    if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
        raise ConfigError("timeout", f"must be None or a number of seconds >= 0, got {timeout!r}")
    db = executor(conn)
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    delay = _FIRST_POLL
    while True:
        state = row(_RESULT_STATE, db, schema, job_id)
        status = _judge(job_id, state)
        if status is None:
            assert state is not None
            return decode_result(state["result"])
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ResultTimeout(job_id, timeout or 0.0, status)
        time.sleep(min(delay, remaining))
        delay = min(2 * delay, _MAX_POLL)
