"""The admin functions a synchronous caller needs: a job, its cancel, its result.

Each runs the async form's statements on a synchronous connection (:mod:`aioq.dbapi`) and
makes the same decisions with the same helpers, so both forms answer alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from aioq.admin import CANCEL_RACES, cancel_outcome, settle_cancels
from aioq.codec import decode_result
from aioq.dbapi import SyncTarget, executor
from aioq.errors import ConfigError, ResultTimeout
from aioq.job import Job, possible_id
from aioq.results import DEFAULT_RESULT_TIMEOUT, judge_result, warn_uncommitted
from aioq.sql import DEFAULT_SCHEMA, control_channel, results_channel
from aioq.sql.admin import GET_ARCHIVED_JOB, GET_JOB
from aioq.sql.control import CANCEL_JOBS, RESULT_STATE

__all__ = ("cancel_jobs_sync", "get_job_sync", "result_sync")

_FIRST_POLL = 0.05  # seconds; then doubling, up to:
_MAX_POLL = 1.0


def get_job_sync(conn: SyncTarget, job_id: int, *, schema: str = DEFAULT_SCHEMA) -> Job | None:
    """Return a job, as :func:`aioq.get_job` does, from synchronous code."""
    if not possible_id(job_id):
        return None
    db = executor(conn)
    found = GET_JOB.row_sync(db, schema, job_id)
    return found if found is not None else GET_ARCHIVED_JOB.row_sync(db, schema, job_id)


def cancel_jobs_sync(
    conn: SyncTarget, job_ids: Sequence[int], *, schema: str = DEFAULT_SCHEMA
) -> dict[int, str]:
    """Cancel jobs wherever they are, as :func:`aioq.cancel_jobs` does, from synchronous code."""
    db = executor(conn)
    ids = sorted({int(i) for i in job_ids})
    channels = (control_channel(schema), results_channel(schema))
    states: dict[int, str] = dict.fromkeys((i for i in ids if not possible_id(i)), "missing")
    ids = [i for i in ids if possible_id(i)]
    for _ in range(CANCEL_RACES):
        if not ids:
            break
        found = {r.id: r.state for r in CANCEL_JOBS.rows_sync(db, schema, ids, *channels, None)}
        ids = settle_cancels(states, found)
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
    warned = False
    while True:
        state = RESULT_STATE.row_sync(db, schema, job_id) if possible_id(job_id) else None
        status = judge_result(job_id, state)
        assert state is not None  # judge_result raised otherwise
        if status is None:
            return decode_result(state.result or "null")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ResultTimeout(job_id, timeout or 0.0, status, uncommitted=state.uncommitted)
        warned = warned or warn_uncommitted(job_id, state)
        time.sleep(min(delay, remaining))
        delay = min(2 * delay, _MAX_POLL)
