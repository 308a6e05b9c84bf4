"""The worker's claim and outcome statements, called the way the worker calls them: for tests
that check the SQL's fence, locks and notifications directly."""

from __future__ import annotations

from collections.abc import Sequence

from aioq.db import Executor
from aioq.job import Claim, OutcomeKind
from aioq.sql import DEFAULT_SCHEMA, results_channel
from aioq.sql.doorbell import ARM_DOORBELL, handover_channel
from aioq.sql.outcomes import HEARTBEAT, WRITE_OUTCOMES, WRITE_STEP_OUTCOMES, WriteOutcomes
from aioq.worker.claimer import Claimer

SCHEMA = DEFAULT_SCHEMA


async def claim(
    db: Executor, queues: Sequence[str], n: int, worker_id: str, *, schema: str = SCHEMA
) -> list[Claim]:
    """Claim up to ``n`` jobs of ``queues`` for ``worker_id`` (limits obeyed)."""
    claimer = Claimer(schema=schema, db=db, queues=queues, worker_id=worker_id, ring=lambda: None)
    return await claimer.claim(n)


def _keys(claims: Sequence[Claim | tuple[int, int]]) -> tuple[list[int], list[int]]:
    keys = [c.key if isinstance(c, Claim) else c for c in claims]
    return [k[0] for k in keys], [k[1] for k in keys]


async def write(
    db: Executor,
    worker_id: str,
    claims: Sequence[Claim | tuple[int, int]],
    kind: OutcomeKind,
    *,
    delay: float = 0.0,
    error: str | None = None,
    result: str | None = None,
    ttl: float | None = None,
    archive: bool = False,
    steps: bool = False,
    schema: str = SCHEMA,
) -> set[int]:
    """Write one outcome for each claim (or (job id, claim number)); return the ids written.

    ``steps``: through WRITE_STEP_OUTCOMES, as a batch holding workflow steps is written."""
    ids, numbers = _keys(claims)
    n = len(ids)
    statement = WRITE_STEP_OUTCOMES if steps else WRITE_OUTCOMES
    outcomes = WriteOutcomes(
        ids=ids,
        claims=numbers,
        worker=worker_id,
        kinds=[kind.value] * n,
        delays=[delay] * n,
        errors=[error] * n,
        results=[result] * n,
        ttls=[ttl] * n,
        archive=archive,
        results_channel=results_channel(schema),
    )
    rows = await statement.rows(db, schema, outcomes)
    return {job_id for job_id, _ in rows}


async def heartbeat(
    db: Executor, worker_id: str, claims: Sequence[Claim | tuple[int, int]], *, schema: str = SCHEMA
) -> set[int]:
    """Extend the leases of these claims; return the ids still held."""
    ids, numbers = _keys(claims)
    return {key[0] for key in await HEARTBEAT.rows(db, schema, ids, numbers, worker_id)}


async def arm(db: Executor, queues: Sequence[str], *, schema: str = SCHEMA) -> bool:
    """Arm the doorbell of these queues on this session, as a worker about to sleep does;
    return whether an insert that may not have rung is in flight."""
    found = await ARM_DOORBELL.rows(
        db, schema, list(queues), list(queues), [], handover_channel(schema), within=10
    )
    return not all(d.covered for d in found)
