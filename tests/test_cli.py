"""The ``aioq`` command line, run as a subprocess against a real database."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import textwrap
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from db import fetch
from procs import (
    AIOQ,
    LISTENERS,
    aioq_cli,
    assert_one_line_error,
    children,
    kill_tree,
    pid_of,
    spawner,
)
from waits import HANG_GUARD, wait_for

from aioq.dev.pgbin import free_port
from aioq.migrate import migrations

TASKS = textwrap.dedent(
    """
    import asyncio
    import os

    import asyncpg

    import aioq

    registry = aioq.Registry()


    @registry.task(name="record")
    async def record(sleep: float = 0.0) -> None:
        job = aioq.current_job()
        conn = await asyncpg.connect(os.environ["AIOQ_DSN"])
        try:
            sql = "INSERT INTO runs (job_id, worker_id, phase) VALUES ($1, $2, $3)"
            await conn.execute(sql, job.id, job.worker_id, "start")
            await asyncio.sleep(sleep)
            await conn.execute(sql, job.id, job.worker_id, "end")
        finally:
            await conn.close()
    """
)


def defer_sql(dsn: str, count: int, sleep: float) -> list[int]:
    rows = fetch(
        dsn,
        "INSERT INTO aioq.jobs (task, args) SELECT 'record', jsonb_build_object('sleep', $2::float8)"
        " FROM generate_series(1, $1) RETURNING id",
        count,
        sleep,
    )
    return [r["id"] for r in rows]


def pid_ofs(dsn: str, job_ids: list[int]) -> set[int]:
    rows = fetch(
        dsn,
        "SELECT DISTINCT worker_id FROM runs WHERE phase = 'end' AND job_id = ANY($1)",
        job_ids,
    )
    return {int(r[0].split(":")[-2]) for r in rows}


def ended(dsn: str, job_ids: list[int]) -> int:
    rows = fetch(dsn, "SELECT count(*) FROM runs WHERE phase = 'end' AND job_id = ANY($1)", job_ids)
    return int(rows[0][0])


@pytest.fixture
def task_dir(tmp_path: Path, dsn: str) -> Path:
    (tmp_path / "clitasks.py").write_text(TASKS)
    fetch(dsn, "CREATE TABLE runs (job_id bigint, worker_id text, phase text)")
    return tmp_path


@pytest.fixture
def spawn(dsn: str) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    with spawner(dsn) as start:
        yield start


def test_missing_dsn_and_unreachable_database() -> None:
    assert_one_line_error(aioq_cli(None, "stats"), "pass --dsn or set AIOQ_DSN")
    bad = "postgresql://nobody@127.0.0.1:1/none"
    assert_one_line_error(aioq_cli(None, "jobs", "list", "--dsn", bad), "cannot reach the database")
    assert aioq_cli(None, "jobs", "frobnicate").returncode == 2  # usage


def test_schema_sql_status_apply(dsn: str) -> None:
    sql = aioq_cli(None, "schema", "sql", "--schema", "other")
    assert sql.returncode == 0
    assert 'CREATE TABLE "other".jobs' in sql.stdout

    latest = len(migrations())
    every = list(range(1, latest + 1))
    status = aioq_cli(dsn, "schema", "status")
    assert status.returncode == 0, status
    assert status.stdout.split("\n")[0].split() == ["SCHEMA", "INSTALLED", "LATEST", "PENDING"]
    assert status.stdout.split("\n")[1].split()[:2] == ["aioq", str(latest)]
    data = json.loads(aioq_cli(dsn, "schema", "status", "--json").stdout)
    assert data == {"schema": "aioq", "installed": latest, "latest": latest, "pending": []}

    pending = aioq_cli(dsn, "schema", "status", "--schema", "other", "--json")
    assert pending.returncode == 1
    assert json.loads(pending.stdout)["pending"] == every
    applied = aioq_cli(dsn, "schema", "apply", "--schema", "other")
    assert applied.returncode == 0
    assert applied.stdout.strip() == f"schema other: applied migrations {' '.join(map(str, every))}"
    again = aioq_cli(dsn, "schema", "apply", "--schema", "other", "--json")
    assert json.loads(again.stdout) == {"schema": "other", "applied": [], "version": latest}
    assert aioq_cli(dsn, "schema", "status", "--schema", "other").returncode == 0


def test_defer_list_show(dsn: str) -> None:
    result = aioq_cli(dsn, "defer", "shop.charge", "--args", '{"order_id": 7}', "--priority", "3")
    assert result.returncode == 0, result
    job_id = int(result.stdout)
    later = aioq_cli(dsn, "defer", "shop.mail", "--queue", "mail", "--delay", "1h", "--json")
    later_id = json.loads(later.stdout)["id"]

    assert_one_line_error(aioq_cli(dsn, "defer", "t", "--args", "[1]"), "must be a JSON object")
    assert_one_line_error(aioq_cli(dsn, "defer", "t", "--args", "{nope"), "not valid JSON")
    assert_one_line_error(aioq_cli(dsn, "defer", "t", "--args", '{"x": "\\u0000"}'), "NUL")
    assert_one_line_error(
        aioq_cli(dsn, "defer", "t", "--unique-key", "k" * 8000), "unique_key", "at most 512"
    )

    table = aioq_cli(dsn, "jobs", "list")
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "ID", "QUEUE", "TASK", "STATUS", "ATTEMPTS", "RUN_AT", "LAST_ERROR"
    ]  # fmt: skip
    assert lines[1].split()[:5] == [str(job_id), "default", "shop.charge", "pending", "0/5"]
    assert lines[2].split()[:3] == [str(later_id), "mail", "shop.mail"]

    listed = json.loads(aioq_cli(dsn, "jobs", "list", "--queue", "mail", "--json").stdout)
    assert [j["id"] for j in listed] == [later_id]
    assert listed[0]["args"] == {}
    none = aioq_cli(dsn, "jobs", "list", "--status", "dead")
    assert none.returncode == 0
    assert "(none)" in none.stdout

    shown = json.loads(aioq_cli(dsn, "jobs", "show", str(job_id), "--json").stdout)
    assert shown["args"] == {"order_id": 7}
    assert shown["priority"] == 3
    assert shown["status"] == "pending"
    text = aioq_cli(dsn, "jobs", "show", str(job_id))
    fields = dict(line.split(":", 1) for line in text.stdout.splitlines())
    assert fields["task"].strip() == "shop.charge"
    assert fields["args"].strip() == '{"order_id": 7}'
    assert fields["cancel_requested_at"].strip() == "-"
    # Every value starts in one column, the longest key's included.
    starts = {len(k) + 1 + len(v) - len(v.lstrip(" ")) for k, v in fields.items()}
    assert starts == {len("cancel_requested_at") + 2}, text.stdout

    missing = aioq_cli(dsn, "jobs", "show", "999999")
    assert missing.returncode == 1
    assert "not found" in missing.stderr


def test_replay_cancel_purge(dsn: str) -> None:
    ids = [int(aioq_cli(dsn, "defer", f"t{i % 2}").stdout) for i in range(4)]
    fetch(
        dsn,
        "UPDATE aioq.jobs SET status = 'dead', attempts = 5, last_error = 'boom'"
        " WHERE id = ANY($1)",
        ids[:3],
    )
    table = aioq_cli(dsn, "jobs", "list", "--status", "dead")
    assert table.stdout.splitlines()[1].split()[3:] == ["dead", "5/5", *table.stdout.splitlines()[1].split()[5:7], "boom"]  # fmt: skip

    replayed = aioq_cli(dsn, "jobs", "replay", str(ids[0]))
    assert (replayed.returncode, replayed.stdout.strip()) == (0, f"replayed 1 job: {ids[0]}")
    again = aioq_cli(dsn, "jobs", "replay", str(ids[0]), "--json")
    assert again.returncode == 1
    assert json.loads(again.stdout) == {"replayed": [], "missing": [ids[0]]}
    by_task = aioq_cli(dsn, "jobs", "replay", "--dead", "--task", "t1", "--json")
    assert json.loads(by_task.stdout) == {"replayed": [ids[1]], "missing": []}
    assert aioq_cli(dsn, "jobs", "replay", "1", "--dead").returncode == 2

    cancelled = aioq_cli(dsn, "jobs", "cancel", str(ids[3]), str(ids[2]))
    assert cancelled.returncode == 1  # ids[2] is dead, not pending
    assert f"cancelled 1 job: {ids[3]}" in cancelled.stdout
    assert f"already dead (not cancelled): {ids[2]}" in cancelled.stdout
    ok = aioq_cli(dsn, "jobs", "cancel", str(ids[0]), "999999", "--json")
    assert (ok.returncode, json.loads(ok.stdout)) == (
        1,
        {"cancelled": [ids[0]], "cancelling": [], "finished": [], "dead": [], "missing": [999999]},
    )
    again = aioq_cli(dsn, "jobs", "cancel", str(ids[0]))  # idempotent
    assert (again.returncode, again.stdout.strip()) == (0, f"cancelled 1 job: {ids[0]}")
    listed = aioq_cli(dsn, "jobs", "list", "--status", "cancelled", "--json")
    assert sorted(j["id"] for j in json.loads(listed.stdout)) == [ids[0], ids[3]]

    young = aioq_cli(dsn, "jobs", "purge", "--dead", "--older-than", "1h")
    assert (young.returncode, young.stdout.strip()) == (0, "purged 0 dead jobs")
    assert_one_line_error(
        aioq_cli(dsn, "jobs", "purge", "--dead", "--older-than", "soon"), "duration"
    )
    purged = aioq_cli(dsn, "jobs", "purge", "--dead", "--json")
    assert json.loads(purged.stdout) == {"purged": 1}
    left = fetch(dsn, "SELECT id, status FROM aioq.jobs ORDER BY id")
    assert [(r["id"], r["status"]) for r in left] == [
        (ids[0], "cancelled"), (ids[1], "pending"), (ids[3], "cancelled")
    ]  # fmt: skip


def test_stats_watch_until_interrupted(
    dsn: str, tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = spawn("stats", "--watch", "0.1", cwd=tmp_path)
    assert proc.stdout is not None
    seen = [proc.stdout.readline() for _ in range(8)]
    assert sum(line.startswith("--- ") for line in seen) >= 2
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=10)
    assert proc.returncode == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stats_watch_ends_on_a_signal_even_when_started_ignoring_sigint(
    dsn: str, tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]], sig: signal.Signals
) -> None:
    """A shell starts a background job with SIGINT ignored, and the child inherits that:
    asyncio's own Ctrl-C handling then never installs itself and the watch never ended."""
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = spawn("stats", "--watch", "0.1", cwd=tmp_path)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("--- ")
    proc.send_signal(sig)
    proc.communicate(timeout=10)
    assert proc.returncode == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stats_watch_ends_on_a_signal_during_its_connect(
    tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]], sig: signal.Signals
) -> None:
    """A server that accepts and never answers: the signal lands inside asyncpg's connect."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(HANG_GUARD)
        port = server.getsockname()[1]
        proc = spawn(
            "stats", "--watch", "0.1", "--dsn", f"postgresql://x@127.0.0.1:{port}/x", cwd=tmp_path
        )
        accepted, _ = server.accept()  # the command is in its connect now
        with accepted:
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert (out, err) == ("", "")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stats_watch_ends_on_a_signal_during_a_statement(
    dsn: str, tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]], sig: signal.Signals
) -> None:
    """The first statement waits on a lock: the signal lands while it runs; the command ends
    at once, closing its connection without waiting for the statement."""
    waiting = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND query LIKE '%aioq%'"
    )
    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE aioq.jobs IN ACCESS EXCLUSIVE MODE")  # its transaction stays
        proc = spawn("stats", "--watch", "0.1", cwd=tmp_path)
        wait_for(lambda: fetch(dsn, waiting), "the stats statement waiting on the lock")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert (out, err) == ("", "")
        wait_for(lambda: not fetch(dsn, waiting), "the command's backend to go")
        holder.rollback()


def test_ids_past_bigint_are_absent_jobs(dsn: str) -> None:
    """An id no job can have (past bigint, or negative) is not found, never a driver error."""
    job_id = int(aioq_cli(dsn, "defer", "t").stdout)
    for absent in (str(2**63), str(2**64 + 5), "-1", str(-(2**63) - 1)):
        shown = aioq_cli(dsn, "jobs", "show", absent)
        assert shown.returncode == 1, shown
        assert f"job {absent} not found" in shown.stderr
        cancelled = aioq_cli(dsn, "jobs", "cancel", absent, str(job_id), "--json")
        assert cancelled.returncode == 1, cancelled
        states = json.loads(cancelled.stdout)
        assert (states["missing"], states["cancelled"]) == ([int(absent)], [job_id])
        replayed = aioq_cli(dsn, "jobs", "replay", absent, "--json")
        assert replayed.returncode == 1, replayed
        assert json.loads(replayed.stdout) == {"replayed": [], "missing": [int(absent)]}


def test_jobs_retry_is_replays_hidden_old_spelling_for_one_release(dsn: str) -> None:
    """`aioq jobs retry` still works, out of the help, saying on stderr that it is deprecated,
    and prints what it printed before (the "retried" text and JSON key) for scripts that read
    it; `aioq jobs replay` says "replayed"."""
    ids = [int(aioq_cli(dsn, "defer", "t").stdout) for _ in range(2)]
    fetch(dsn, "UPDATE aioq.jobs SET status = 'dead' WHERE id = ANY($1)", ids)
    old = aioq_cli(dsn, "jobs", "retry", str(ids[0]), "--json")
    assert old.returncode == 0, old
    assert json.loads(old.stdout) == {"retried": [ids[0]], "missing": []}
    assert old.stderr == (
        "aioq: 'aioq jobs retry' is deprecated and will be removed in the next release: use"
        ' \'aioq jobs replay\' (its --json says "replayed" instead of "retried")\n'
    )
    text = aioq_cli(dsn, "jobs", "retry", "--dead")
    assert (text.returncode, text.stdout) == (0, f"retried 1 job: {ids[1]}\n")
    assert "deprecated" in text.stderr
    new = aioq_cli(dsn, "jobs", "replay", "--dead", "--json")
    assert (new.returncode, json.loads(new.stdout), new.stderr) == (
        0,
        {"replayed": [], "missing": []},
        "",
    )
    helped = aioq_cli(dsn, "jobs", "--help")
    assert "replay" in helped.stdout
    assert "retry" not in helped.stdout
    assert aioq_cli(dsn, "jobs", "retry", "1", "--dead").stderr.endswith(
        "aioq: error: jobs retry: give job ids or --dead (not both)\n"
    )


def test_limits_and_ports_out_of_range_are_usage_errors(dsn: str, task_dir: Path) -> None:
    """A --limit past what PostgreSQL's LIMIT takes (bigint) or a port past 65535 is a usage
    error naming the flag, never "database error" nor a traceback."""
    huge = "99999999999999999999"
    for command in (("jobs", "list"), ("workflows", "list")):
        assert_one_line_error(aioq_cli(dsn, *command, "--limit", huge), "--limit", "at most")
        largest = aioq_cli(dsn, *command, "--limit", str(2**63 - 1), "--json")
        assert (largest.returncode, json.loads(largest.stdout)) == (0, []), largest
    assert_one_line_error(aioq_cli(dsn, "web", "--port", "99999"), "--port", "1 to 65535")
    for port in ("99999", "0"):
        worker = aioq_cli(dsn, "worker", "clitasks", "--metrics-port", port, cwd=task_dir)
        assert_one_line_error(worker, "--metrics-port", "1 to 65535")
    past = aioq_cli(
        dsn, "worker", "clitasks", "--processes", "3", "--metrics-port", "65534", cwd=task_dir
    )
    assert_one_line_error(past, "--metrics-port: 65534 + 3 processes runs past port 65535")
    with socket.socket() as taken:  # a port in use: the port is named, not the database
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = aioq_cli(
            dsn, "worker", "clitasks", "--metrics-port", str(port), "--metrics-addr",
            "127.0.0.1", cwd=task_dir,
        )  # fmt: skip
    assert_one_line_error(busy, f"--metrics-port: cannot serve on 127.0.0.1:{port}")


def test_stats_watch_needs_a_sane_interval(dsn: str) -> None:
    for interval in ("0", "0.01"):
        assert_one_line_error(
            aioq_cli(dsn, "stats", "--watch", interval), "--watch must be at least 0.1 seconds"
        )


def test_stats_and_check(dsn: str) -> None:
    empty = aioq_cli(dsn, "stats")
    assert empty.returncode == 0
    assert "(none)" in empty.stdout
    assert "jobs table:" in empty.stdout
    for _ in range(2):
        aioq_cli(dsn, "defer", "t", "--queue", "q1")
    aioq_cli(dsn, "defer", "t", "--queue", "q2", "--delay", "1h")
    fetch(dsn, "UPDATE aioq.jobs SET run_at = now() - interval '2 minutes' WHERE queue = 'q1'")
    fetch(dsn, "INSERT INTO aioq.jobs (queue, task, status) VALUES ('q2', 't', 'dead')")
    q2_ids = [int(aioq_cli(dsn, "defer", "t", "--queue", "q2").stdout) for _ in range(2)]
    cancelled = aioq_cli(dsn, "jobs", "cancel", *map(str, q2_ids))
    assert cancelled.returncode == 0, cancelled

    table = aioq_cli(dsn, "stats").stdout.splitlines()
    assert table[0].split() == [
        "QUEUE", "READY", "SCHEDULED", "WAITING", "RUNNING", "DEAD", "CANCELLED",
        "OLDEST_READY_S", "EXPIRED_LEASES", "COMPLETED_1M", "FAILED_1M",
    ]  # fmt: skip
    q1 = table[1].split()
    assert q1[:7] == ["q1", "2", "0", "0", "0", "0", "0"]
    assert 120 <= float(q1[7]) < 180
    assert q1[8:] == ["0", "n/a", "n/a"]
    assert table[2].split() == ["q2", "0", "1", "0", "0", "1", "2", "0.0", "0", "n/a", "n/a"]

    data = json.loads(aioq_cli(dsn, "stats", "--json").stdout)
    assert [q["queue"] for q in data["queues"]] == ["q1", "q2"]
    assert data["queues"][1]["dead"] == 1
    assert [q["cancelled"] for q in data["queues"]] == [0, 2]
    assert data["queues"][1]["completed_last_minute"] is None
    assert data["queues"][1]["failed_last_minute"] is None
    assert data["table"]["table_bytes"] > 0
    assert data["archived"] is False

    ok = aioq_cli(dsn, "stats", "--check", "--max-age", "1h", "--max-dead", "1")
    assert ok.returncode == 0
    assert "check ok" in ok.stdout
    bad = aioq_cli(dsn, "stats", "--check", "--max-age", "60", "--max-dead", "0")
    assert bad.returncode == 1
    assert "CHECK FAILED: queue q1: oldest ready job is" in bad.stdout
    assert "CHECK FAILED: queue q2: 1 dead jobs (--max-dead 0)" in bad.stdout
    checked = json.loads(aioq_cli(dsn, "stats", "--check", "--max-dead", "0", "--json").stdout)
    assert checked["check"] == {"ok": False, "failures": ["queue q2: 1 dead jobs (--max-dead 0)"]}
    assert aioq_cli(dsn, "stats", "--max-dead", "0").returncode == 2


def test_worker_processes_drain_and_replace_a_killed_child(
    dsn: str, task_dir: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    args = ("worker", "clitasks:registry", "--processes", "2", "--concurrency", "5")
    sup = spawn(*args, "--poll-interval", "0.2", "--shutdown-grace", "5", cwd=task_dir)
    wait_for(lambda: len(children(sup.pid)) == 2, what="two children")
    first = children(sup.pid)
    wait_for(
        lambda: {pid_of(r[0]) for r in fetch(dsn, LISTENERS)} == first,
        what="both children listening",
    )

    jobs = defer_sql(dsn, 20, 0.2)
    wait_for(lambda: ended(dsn, jobs) == 20, what="20 jobs")
    assert pid_ofs(dsn, jobs) == first  # both children did work

    victim = min(first)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(children(sup.pid) - first) == 1, what="a replacement child")
    replacement = (children(sup.pid) - first).pop()
    wait_for(
        lambda: replacement in {pid_of(r[0]) for r in fetch(dsn, LISTENERS)},
        what="the replacement listening",
    )

    more = defer_sql(dsn, 15, 0.3)
    wait_for(lambda: ended(dsn, more) == 15, what="15 more jobs")
    assert replacement in pid_ofs(dsn, more)

    sup.send_signal(signal.SIGTERM)
    _, stderr = sup.communicate(timeout=20)
    assert sup.returncode == 0, stderr
    assert f"(pid {victim}) was killed by SIGKILL; restarting it" in stderr
    assert fetch(dsn, "SELECT count(*) FROM aioq.jobs")[0][0] == 0


def test_sigterm_lets_a_running_job_finish(
    dsn: str, task_dir: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = spawn("worker", "clitasks", "--log-format", "json", "--poll-interval", "0.2",
                 cwd=task_dir)  # fmt: skip
    (job,) = defer_sql(dsn, 1, 1.5)
    wait_for(lambda: bool(fetch(dsn, "SELECT 1 FROM runs WHERE job_id = $1", job)), what="start")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0, stderr
    assert ended(dsn, [job]) == 1
    assert fetch(dsn, "SELECT count(*) FROM aioq.jobs")[0][0] == 0
    records = [json.loads(line) for line in stderr.splitlines()]
    outcome = next(r for r in records if r.get("job_id") == job)
    assert outcome["level"] == "INFO"
    assert outcome["logger"].startswith("aioq.")
    assert (outcome["task"], outcome["queue"], outcome["attempt"]) == ("record", "default", 1)
    assert outcome["duration_s"] >= 1.5
    assert {"time", "message", "outcome"} <= outcome.keys()


def test_log_level_warning_drops_the_per_job_lines_but_keeps_dead_jobs(
    dsn: str, task_dir: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    # --unknown-task-grace reaches the children: the unknown task's job is dead at once.
    proc = spawn("worker", "clitasks", "--processes", "2", "--log-format", "json",
                 "--log-level", "warning", "--poll-interval", "0.2",
                 "--unknown-task-grace", "0", cwd=task_dir)  # fmt: skip
    jobs = defer_sql(dsn, 5, 0.0)
    [unknown] = fetch(
        dsn,
        "INSERT INTO aioq.jobs (task, args, max_attempts) VALUES ('nope', '{}', 1) RETURNING id",
    )
    wait_for(lambda: ended(dsn, jobs) == 5, what="jobs to run")
    wait_for(lambda: bool(fetch(dsn, "SELECT 1 FROM aioq.jobs WHERE status = 'dead'")), what="dead")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert {r["level"] for r in records} <= {"WARNING", "ERROR"}, records
    assert not [r for r in records if r.get("outcome") == "succeeded"]
    [dead] = [r for r in records if r.get("outcome") == "dead"]
    assert dead["job_id"] == unknown["id"]


def test_a_stop_signal_while_children_are_still_starting_stops_them_cleanly(
    task_dir: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    # SIGTERM as soon as the second child is started: the children are still importing, so
    # without the blocked start-up mask the default action killed them ("killed by SIGTERM").
    proc = spawn("worker", "clitasks", "--processes", "2", cwd=task_dir)
    assert proc.stderr is not None
    wait_for(lambda: "started child 1" in proc.stderr.readline(), what="the second child")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "killed by" not in stderr, stderr


def test_second_signal_stops_at_once_and_releases_the_job(
    dsn: str, task_dir: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = spawn("worker", "clitasks", "--shutdown-grace", "60", cwd=task_dir)
    (job,) = defer_sql(dsn, 1, 60)
    wait_for(lambda: bool(fetch(dsn, "SELECT 1 FROM runs WHERE job_id = $1", job)), what="start")
    proc.send_signal(signal.SIGTERM)
    wait_for(
        lambda: "stopping gracefully" in (proc.stderr.readline() if proc.stderr else ""),
        what="the graceful stop",
    )
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == 0, stderr
    row = fetch(dsn, "SELECT status, attempts FROM aioq.jobs WHERE id = $1", job)[0]
    assert (row["status"], row["attempts"]) == ("pending", 0)


def test_worker_usage_errors(dsn: str, tmp_path: Path) -> None:
    assert_one_line_error(aioq_cli(dsn, "worker", "no_such_module", cwd=tmp_path), "cannot import")
    (tmp_path / "m.py").write_text("x = 1\n")
    assert_one_line_error(aioq_cli(dsn, "worker", "m:x", cwd=tmp_path), "is not an aioq.Registry")


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--poll-interval", "inf", "is not a duration"),
        ("--poll-interval", "nan", "is not a duration"),
        ("--poll-interval", "-1", "is not a duration"),
        ("--poll-interval", "0", "between 0.001 and"),
        ("--poll-interval", "40000d", "between 0.001 and"),  # past MAX_DURATION (a century)
        ("--shutdown-grace", "40000d", "between 0 and"),
        ("--command-timeout", "0", "between 0.001 and"),
    ],
)
@pytest.mark.parametrize("processes", ["1", "2"])
def test_worker_refuses_bad_durations_before_starting(
    dsn: str, task_dir: Path, flag: str, value: str, says: str, processes: str
) -> None:
    # As typed: before the fix a supervisor's children failed on 0 and were restarted
    # forever, and 40000d started a worker that would never poll.
    proc = subprocess.Popen(
        [AIOQ, "worker", "clitasks", "--processes", processes, flag, value],
        env={**os.environ, "AIOQ_DSN": dsn},
        cwd=task_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=30)  # a hang guard
    finally:
        kill_tree(proc)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert_one_line_error(result, f"argument {flag}: ", says)
    assert stdout == ""


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return None


def test_worker_serves_metrics_per_process(
    dsn: str, task_dir: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    base = free_port()
    proc = spawn("worker", "clitasks", "--processes", "2", "--metrics-port", str(base),
                 "--metrics-addr", "127.0.0.1", "--poll-interval", "0.2", cwd=task_dir)  # fmt: skip
    jobs = defer_sql(dsn, 20, 0.0)
    wait_for(lambda: ended(dsn, jobs) == 20, what="jobs to run")
    # Child i serves on base + i; together they count every job that succeeded. A child counts
    # a job just after its completion commits, so the pages may lag the database briefly.
    for port in (base, base + 1):
        wait_for(lambda port=port: _scrape(port) is not None, what=f"metrics on {port}")

    def succeeded() -> float:
        total = 0.0
        for port in (base, base + 1):
            for line in (_scrape(port) or "").splitlines():
                if line.startswith("aioq_jobs_succeeded_total{"):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    wait_for(lambda: succeeded() >= 20, what="the counters to reach 20")
    assert succeeded() == 20
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 0
