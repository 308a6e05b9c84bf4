"""Task functions called directly, as plain functions, with a job context: no database."""

from __future__ import annotations

import pytest
from shop import make_thumbnail, send_welcome

from aioq.testing import job_context


def test_a_thumbnail_is_named_after_its_job() -> None:
    with job_context(id=7, task=make_thumbnail):  # task= fills its name and queue
        assert make_thumbnail("cat.png") == "cat-thumb-7.png"


@pytest.mark.anyio
async def test_a_bounce_fails_even_on_the_last_attempt() -> None:
    with job_context(attempt=3, task=send_welcome) as job:
        assert job.is_last_attempt  # send_welcome has max_attempts=3
        with pytest.raises(ConnectionError, match="unavailable"):
            await send_welcome("bob@bounce.example")
