"""What the database itself can do: aioq's own claim and complete SQL with no worker around it.

    python ceiling.py --dsn ... --mode loop --connections 4 --batch 50 --n 50000
    python ceiling.py --dsn ... --mode pgbench --connections 8 --batch 50 --n 50000

``loop``: k asyncpg connections, each claiming ``--batch`` jobs per statement (aioq's
CLAIM_ONE_QUEUE rendered for the schema) and deleting them in one statement (a bare DELETE
fenced as aioq fences, on id, claim number and worker), until the table is empty.

``pgbench``: the same claim statement in a pgbench script, then a delete of the client's
running rows (pgbench cannot pass the claimed ids on as arrays), ``-t`` transactions per client.
Jobs done = rows gone; time = pgbench's wall clock.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

import asyncpg
from aioq.sql.jobs import CLAIM_ONE_QUEUE

CLAIM = CLAIM_ONE_QUEUE.text("aioq")
# The raw loop's completion: a batch of claimed jobs deleted under the same fence as aioq's
# (id, claim number, owner, running), without aioq's other outcome kinds.
COMPLETE = """
DELETE FROM aioq.jobs AS j
USING unnest($1::bigint[], $2::integer[]) AS f(id, claim)
WHERE j.id = f.id AND j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
RETURNING j.id
"""
PRELOAD = (
    "INSERT INTO aioq.jobs (queue, task, args)"
    " SELECT 'default', 'noop', jsonb_build_object('i', g) FROM generate_series(1, $1) AS g"
)


def pgbench_binary() -> str | None:
    found = shutil.which("pgbench")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"))
    return candidates[-1] if candidates else None


async def preload(dsn: str, n: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(PRELOAD, n)
        await conn.execute("VACUUM ANALYZE aioq.jobs")
    finally:
        await conn.close()


async def loop(args: argparse.Namespace) -> dict[str, Any]:
    await preload(args.dsn, args.n)
    conns = [await asyncpg.connect(args.dsn) for _ in range(args.connections)]

    async def work(conn: asyncpg.Connection, me: str) -> int:
        done = 0
        while True:
            rows = await conn.fetch(CLAIM, "default", args.batch, me, [], 0.0)
            if not rows:
                return done
            ids = [r["id"] for r in rows]
            numbers = [r["claims"] for r in rows]
            done += len(await conn.fetch(COMPLETE, ids, numbers, me))

    for conn in conns:  # prepare the statements before the clock starts
        await conn.prepare(CLAIM)
        await conn.prepare(COMPLETE)
    t0 = time.perf_counter()
    done = await asyncio.gather(*(work(c, f"ceiling-{k}") for k, c in enumerate(conns)))
    seconds = time.perf_counter() - t0
    for conn in conns:
        await conn.close()
    return {"rate": sum(done) / seconds, "seconds": seconds, "jobs": sum(done)}


async def pgbench(args: argparse.Namespace) -> dict[str, Any]:
    binary = pgbench_binary()
    if binary is None:
        return {"error": "pgbench not found (apt-get install postgresql-client)"}
    per_client = max(1, args.n // (args.connections * args.batch))
    margin = 2 * args.connections * args.batch  # never let a claim come back empty
    total = per_client * args.connections * args.batch
    await preload(args.dsn, total + margin)
    me = "('pgbench-' || :client_id)"
    claim = CLAIM.replace("$1", "'default'").replace("$2", ":batch").replace("$3", me)
    script = (
        " ".join(claim.split()) + ";\n"
        f"DELETE FROM aioq.jobs WHERE status = 'running' AND locked_by = {me};\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "claim_complete.sql")
        with open(path, "w") as f:
            f.write(script)
        cmd = [binary, "-n", "-f", path, "-c", str(args.connections)]
        cmd += ["-j", str(min(args.connections, os.cpu_count() or 1))]
        cmd += ["-t", str(per_client), "-D", f"batch={args.batch}", args.dsn]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
        seconds = time.perf_counter() - t0
    if out.returncode != 0:
        return {"error": f"pgbench exit {out.returncode}: {out.stderr.strip()[-300:]}"}
    conn = await asyncpg.connect(args.dsn)
    left = await conn.fetchval("SELECT count(*) FROM aioq.jobs")
    await conn.close()
    jobs = total + margin - left
    tps = next(
        (float(line.split()[2]) for line in out.stdout.splitlines() if line.startswith("tps =")),
        None,
    )
    return {"rate": jobs / seconds, "seconds": seconds, "jobs": jobs, "pgbench_tps": tps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--mode", choices=("loop", "pgbench"), required=True)
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--n", type=int, default=50_000)
    args = parser.parse_args()
    result = asyncio.run(loop(args) if args.mode == "loop" else pgbench(args))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
