"""aioq: an asyncio-native background-job queue that lives in your PostgreSQL database.

The top level is what an application writes: tasks and their schedules, workflows, the worker,
the running job's context, a result, the schema's install, and the errors application code
raises or catches. Operations on a queue (inspect, cancel, replay, limits, statistics) are in
:mod:`aioq.admin`; every error class in :mod:`aioq.errors` (both imported with ``aioq``).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from aioq import admin as admin
from aioq import errors as errors
from aioq.backoff import Backoff
from aioq.errors import (
    AioqError,
    ArgumentError,
    Fail,
    JobCancelled,
    JobFailed,
    ResultMissing,
    ResultTimeout,
    Retry,
)
from aioq.job import JobContext, StepFailed, current_job
from aioq.migrate import install
from aioq.periodic import periodic
from aioq.registry import Registry, task
from aioq.results import result, result_sync
from aioq.tasks import Task
from aioq.worker import Worker, WorkerConfig
from aioq.workflows import Workflow, chain, group, workflow, workflow_sync

__version__ = "0.1.0"

__all__ = (
    "AioqError",
    "ArgumentError",
    "Backoff",
    "Fail",
    "JobCancelled",
    "JobContext",
    "JobFailed",
    "Registry",
    "ResultMissing",
    "ResultTimeout",
    "Retry",
    "StepFailed",
    "Task",
    "Worker",
    "WorkerConfig",
    "Workflow",
    "__version__",
    "chain",
    "current_job",
    "group",
    "install",
    "periodic",
    "result",
    "result_sync",
    "task",
    "workflow",
    "workflow_sync",
)

MOVED = {
    "ConfigError": "aioq.errors.ConfigError",
    "DeferError": "aioq.errors.DeferError",
    "JobControl": "aioq.errors.JobControl",
    "NoResult": "aioq.errors.NoResult",
    "OptionError": "aioq.errors.OptionError",
    "PayloadError": "aioq.errors.PayloadError",
    "ResultError": "aioq.errors.ResultError",
    "SchemaError": "aioq.errors.SchemaError",
    "SerializationError": "aioq.errors.SerializationError",
    "ServerError": "aioq.errors.ServerError",
    "StartupError": "aioq.errors.StartupError",
    "TaskError": "aioq.errors.TaskError",
    "UnknownTaskError": "aioq.errors.UnknownTaskError",
    "Job": "aioq.admin.Job",
    "JobStatus": "aioq.admin.JobStatus",
    "QueueInfo": "aioq.admin.QueueInfo",
    "QueueStats": "aioq.admin.QueueStats",
    "Replay": "aioq.admin.Replay",
    "Stats": "aioq.admin.Stats",
    "TableStats": "aioq.admin.TableStats",
    "WorkflowInfo": "aioq.admin.WorkflowInfo",
    "WorkflowStep": "aioq.admin.WorkflowStep",
    "cancel_jobs": "aioq.admin.cancel_jobs",
    "cancel_jobs_sync": "aioq.admin.cancel_jobs_sync",
    "cancel_workflow": "aioq.admin.cancel_workflow",
    "delete_jobs": "aioq.admin.delete_jobs",
    "get_job": "aioq.admin.get_job",
    "get_job_sync": "aioq.admin.get_job_sync",
    "list_jobs": "aioq.admin.list_jobs",
    "list_workflows": "aioq.admin.list_workflows",
    "purge_dead": "aioq.admin.purge_dead",
    "queues": "aioq.admin.queues",
    "retry_dead": "aioq.admin.replay",
    "ring": "aioq.admin.ring",
    "ring_sync": "aioq.admin.ring_sync",
    "schema_sql": "aioq.admin.schema_sql",
    "set_queue": "aioq.admin.set_queue",
    "stats": "aioq.admin.stats",
    "Schedule": "aioq.schedule.Schedule",
    "Step": "aioq.workflows.Step",
    "WorkflowRun": "aioq.workflows.WorkflowRun",
    "Call": "aioq.tasks.Call",
    "TaskCall": "aioq.tasks.TaskCall",
    "default_registry": "aioq.registry.default_registry",
}
"""Names that left the top level, and where each is now. CHANGELOG.md, "Moved"."""


if not TYPE_CHECKING:  # mypy reports an old name as missing; at run time it warns

    def __getattr__(name: str) -> Any:
        """Return a name that moved, with a DeprecationWarning naming its new place."""
        new = MOVED.get(name)
        if new is None:
            raise AttributeError(f"module 'aioq' has no attribute {name!r}")
        warnings.warn(
            f"aioq.{name} moved: use {new} (aioq.{name} goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        module, _, attribute = new.rpartition(".")
        return getattr(importlib.import_module(module), attribute)
