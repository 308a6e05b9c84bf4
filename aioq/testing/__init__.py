"""Helpers for testing code that uses aioq: ``job_context`` for calling tasks directly."""

from aioq.testing.context import job_context

__all__ = ("job_context",)
