"""Process faults: worker processes SIGKILLed mid-drain; a worker SIGSTOPped past its lease."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import (
    HANG_GUARD,
    LONG,
    Fault,
    Result,
    Sql,
    WorkerProcess,
    archived,
    backends_of,
    busy_backends_of,
    check_drained,
    defer,
    defer_sticky,
    jitter,
    listening_pids,
    pending,
    pid_of,
    running_ids,
    wait_for,
    wait_serving,
)

pytestmark = pytest.mark.chaos

KILL_JOBS = 5000 if LONG else 2000
KILLS = 40 if LONG else 10
KILL_INTERVAL = 0.5
PROCESSES = 3
CONCURRENCY = 10


def test_sigkill_random_workers_mid_drain(
    dsn: str,
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
) -> None:
    """Kill a random child of the supervisor every ~0.5 s; nothing is lost, repeats are bounded."""
    sql = open_sql(dsn)
    jobs = defer(sql, KILL_JOBS, max_sleep=0.3)
    fleet = fleets(workdir, dsn, processes=PROCESSES, concurrency=CONCURRENCY)
    wait_serving(fleet, sql)
    started = time.monotonic()
    faults: list[Fault] = []
    rescue_s: list[float] = []
    while len(faults) < KILLS and pending(sql) > 0:
        time.sleep(jitter(KILL_INTERVAL))
        fleet.assert_alive()
        # Only a child that is serving holds jobs; one the supervisor is restarting may not.
        serving = fleet.children() & listening_pids(sql)
        if not serving:
            continue
        victim = random.choice(sorted(serving))
        at = time.time()
        os.kill(victim, signal.SIGKILL)
        # Once its connections are gone, nothing it sent can still commit: what it holds now
        # is exactly what it held when it died.
        wait_for(lambda v=victim: backends_of(sql, v) == 0, f"pid {victim}'s connections gone", 60)
        faults.append(Fault(at, at, running_ids(sql, victim), note=f"SIGKILL {victim}"))
    assert len(faults) == KILLS, f"the queue drained after {len(faults)} kills: add jobs"

    wait_for(lambda: archived(sql) == len(jobs), f"{len(jobs)} jobs archived")
    wall = time.monotonic() - started
    fleet.assert_alive()
    # How long the killed workers' jobs waited to be rescued and completed by someone else.
    for fault in faults:
        if fault.in_flight:
            done = sql.value(
                "SELECT extract(epoch FROM max(finished_at)) FROM aioq.archive WHERE id = ANY($1)",
                list(fault.in_flight),
            )
            rescue_s.append(float(done) - fault.started)
    replaced = [m for m in fleet.messages() if "was killed by SIGKILL; restarting" in m]
    assert len(replaced) == KILLS, replaced
    # The supervisor backs off restarting a child that keeps dying (up to 30 s).
    backoff = sorted(float(m.rsplit(" in ", 1)[1].rstrip("s")) for m in replaced)
    assert fleet.stop() == 0

    lost, duplicates, bound = check_drained(sql, jobs, faults, fleet)
    Result(
        "1 sigkill",
        len(jobs),
        PROCESSES,
        CONCURRENCY,
        len(faults),
        lost,
        duplicates,
        bound,
        rescue_s,
        wall,
        notes={
            "restart_backoff_s": {"median": backoff[len(backoff) // 2], "max": backoff[-1]},
            "recover": "kill -> last job it held completed (lease, reaper, then the backlog)",
        },
    ).report()


THEFTS = 3 if LONG else 1


def test_lease_theft_stale_completion_is_fenced(
    dsn: str,
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
) -> None:
    """SIGSTOP the holder of a short-lease job past its lease; another worker's reaper rescues
    it and completes it; on SIGCONT the stale completion changes nothing and says so."""
    sql = open_sql(dsn)
    fleet = fleets(workdir, dsn, processes=2, concurrency=4)
    pids = wait_serving(fleet, sql)
    background = defer(sql, 400 if LONG else 150, max_sleep=0.01)
    jobs = list(background)
    faults: list[Fault] = []
    recover_s: list[float] = []
    started = time.monotonic()
    for round_ in range(THEFTS):
        release = workdir / f"release-{round_}"
        job = defer_sticky(sql, release)
        jobs.append(job)

        def holder(job: int = job) -> int | None:
            """The pid running the first attempt, once it did its work (and now waits)."""
            pid: int | None = sql.value(
                "SELECT pid FROM chaos_runs WHERE job_id = $1 AND attempt = 1", job
            )
            return pid

        wait_for(lambda: holder() is not None, f"job {job}'s first attempt running", 60)
        stale = holder()
        assert stale is not None
        os.kill(stale, signal.SIGSTOP)
        fleet.stopped.add(stale)
        at = time.time()
        # A statement it sent before it stopped may still be running: wait for it to end.
        wait_for(lambda stale=stale: busy_backends_of(sql, stale) == 0, "its statements", 30)
        faults.append(Fault(at, at, running_ids(sql, stale), note=f"SIGSTOP {stale}"))
        assert job in faults[-1].in_flight

        # The other worker's reaper returns the job to pending once the lease is over; it
        # claims it again (attempt 2) and completes it.
        wait_for(
            lambda job=job: (
                sql.value("SELECT worker FROM aioq.archive WHERE id = $1", job) is not None
            ),
            f"job {job} rescued and completed",
            60,
        )
        rescuer, attempts = sql.fetch(
            "SELECT worker, attempts FROM aioq.archive WHERE id = $1", job
        )[0]
        assert pid_of(rescuer) != stale
        assert attempts == 2
        # Rescued by the reaper of the other worker (the stopped one can run nothing).
        assert any("expired leases rescued" in m for m in fleet.messages(pid_of(rescuer)))
        recover_s.append(time.time() - at)

        release.touch()  # the stale first attempt now finishes as soon as it runs again
        os.kill(stale, signal.SIGCONT)
        fleet.stopped.discard(stale)
        fenced = f"job {job} sticky: lease lost before its outcome (succeeded) was written"
        wait_for(
            lambda stale=stale, fenced=fenced: any(
                m.startswith(fenced) for m in fleet.messages(stale)
            ),
            "the stale worker's lease-lost warning",
            60,
        )
        # The rescuer's state stands: one archive row, written by the rescuer.
        assert sql.fetch("SELECT worker, attempts FROM aioq.archive WHERE id = $1", job) == [
            (rescuer, 2)
        ]
        runs = sql.fetch(
            "SELECT attempt, pid FROM chaos_runs WHERE job_id = $1 ORDER BY attempt", job
        )
        assert [(r["attempt"], r["pid"]) for r in runs] == [(1, stale), (2, pid_of(rescuer))]

    wait_for(lambda: archived(sql) == len(jobs), f"{len(jobs)} jobs archived", HANG_GUARD)
    assert fleet.children() == pids, "a worker exited or was replaced"
    wall = time.monotonic() - started
    assert fleet.stop() == 0
    lost, duplicates, bound = check_drained(sql, jobs, faults, fleet)
    assert duplicates >= THEFTS  # each stolen job ran twice: the stale run and the rescuer's
    Result(
        "4 lease theft",
        len(jobs),
        2,
        4,
        len(faults),
        lost,
        duplicates,
        bound,
        recover_s,
        wall,
        notes={"recover": "SIGSTOP -> rescuer completed the job (lease 2 s, reaper every 5 s)"},
    ).report()


def test_stale_outcome_while_the_rescuer_runs_the_job_is_fenced(
    dsn: str,
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
) -> None:
    """SIGSTOP the holder of a short-lease job past its lease; another worker rescues it and
    runs it again, and holds it. On SIGCONT the stale worker's outcome (and its heartbeat)
    arrives while the row is the rescuer's, running: it must change nothing. A write that
    found its rows by anything but the fenced lookup would delete the rescuer's row."""
    sql = open_sql(dsn)
    fleet = fleets(workdir, dsn, processes=2, concurrency=4)
    pids = wait_serving(fleet, sql)
    background = defer(sql, 150, max_sleep=0.01)
    jobs = list(background)
    faults: list[Fault] = []
    started = time.monotonic()
    for round_ in range(THEFTS):
        release, second = workdir / f"stale-{round_}", workdir / f"rescuer-{round_}"
        job = defer_sticky(sql, release, second)
        jobs.append(job)

        def attempt_pid(n: int, job: int = job) -> int | None:
            pid: int | None = sql.value(
                "SELECT pid FROM chaos_runs WHERE job_id = $1 AND attempt = $2", job, n
            )
            return pid

        wait_for(lambda: attempt_pid(1) is not None, f"job {job}'s first attempt running", 60)
        stale = attempt_pid(1)
        assert stale is not None
        os.kill(stale, signal.SIGSTOP)
        fleet.stopped.add(stale)
        at = time.time()
        wait_for(lambda stale=stale: busy_backends_of(sql, stale) == 0, "its statements", 30)
        faults.append(Fault(at, at, running_ids(sql, stale), note=f"SIGSTOP {stale}"))
        # Rescued by the other worker's reaper, claimed again, and held by its second attempt.
        wait_for(lambda: attempt_pid(2) is not None, f"job {job} rescued and running again", 60)
        rescuer = attempt_pid(2)
        assert rescuer is not None
        assert rescuer != stale
        held = sql.fetch("SELECT status, claims, locked_by FROM aioq.jobs WHERE id = $1", job)

        release.touch()  # the stale first attempt ends as soon as it runs again
        os.kill(stale, signal.SIGCONT)
        fleet.stopped.discard(stale)
        fenced = f"job {job} sticky: lease lost before its outcome (succeeded) was written"
        wait_for(
            lambda stale=stale, fenced=fenced: any(
                m.startswith(fenced) for m in fleet.messages(stale)
            ),
            "the stale worker's lease-lost warning",
            60,
        )
        # The rescuer's claim stands: the same row, running under the same claim.
        assert held[0]["status"] == "running"
        assert pid_of(held[0]["locked_by"]) == rescuer
        assert (
            sql.fetch("SELECT status, claims, locked_by FROM aioq.jobs WHERE id = $1", job) == held
        )
        assert sql.value("SELECT count(*) FROM aioq.archive WHERE id = $1", job) == 0

        second.touch()  # now the rescuer completes it
        wait_for(
            lambda job=job: (
                sql.value("SELECT worker FROM aioq.archive WHERE id = $1", job) is not None
            ),
            f"job {job} completed by the rescuer",
            60,
        )
        worker, attempts = sql.fetch(
            "SELECT worker, attempts FROM aioq.archive WHERE id = $1", job
        )[0]
        assert (pid_of(worker), attempts) == (rescuer, 2)

    wait_for(lambda: archived(sql) == len(jobs), f"{len(jobs)} jobs archived", HANG_GUARD)
    assert fleet.children() == pids, "a worker exited or was replaced"
    wall = time.monotonic() - started
    assert fleet.stop() == 0
    lost, duplicates, bound = check_drained(sql, jobs, faults, fleet)
    assert duplicates >= THEFTS
    Result(
        "4b stale outcome while the rescuer runs",
        len(jobs),
        2,
        4,
        len(faults),
        lost,
        duplicates,
        bound,
        [],
        wall,
        notes={"fence": "the stale success arrived while the rescuer held the row: no change"},
    ).report()
