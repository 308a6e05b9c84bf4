"""The tasks of the getting-started guide (docs/getting-started.md): `aioq worker tasks`."""

from __future__ import annotations

import aioq


@aioq.task(queue="email", max_attempts=5)
async def send_receipt(order_id: int, email: str) -> None:
    """Mail a receipt; a failure is retried with backoff, 5 runs at most."""
    job = aioq.current_job()
    if email.endswith("@flaky.example") and job.attempt == 1:
        raise ConnectionError("mail server busy")  # the worker retries it a moment later
    print(f"receipt for order {order_id} mailed to {email} (job {job.id}, attempt {job.attempt})")
