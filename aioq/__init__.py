"""aioq: an asyncio-native background-job queue that lives in your PostgreSQL database."""

from aioq.admin import get_job, list_jobs, retry_dead
from aioq.errors import (
    AioqError,
    ArgumentError,
    ConfigError,
    DeferError,
    Fail,
    JobControl,
    PayloadError,
    Retry,
    SchemaError,
    SerializationError,
    ServerError,
    TaskError,
    UnknownTaskError,
)
from aioq.job import Job, JobContext, JobStatus, current_job
from aioq.migrate import install, schema_sql
from aioq.task import Backoff, Registry, Task, TaskCall, default_registry, task
from aioq.worker import Worker, WorkerConfig

__version__ = "0.1.0"

__all__ = (
    "AioqError",
    "ArgumentError",
    "Backoff",
    "ConfigError",
    "DeferError",
    "Fail",
    "Job",
    "JobContext",
    "JobControl",
    "JobStatus",
    "PayloadError",
    "Registry",
    "Retry",
    "SchemaError",
    "SerializationError",
    "ServerError",
    "Task",
    "TaskCall",
    "TaskError",
    "UnknownTaskError",
    "Worker",
    "WorkerConfig",
    "__version__",
    "current_job",
    "default_registry",
    "get_job",
    "install",
    "list_jobs",
    "retry_dead",
    "schema_sql",
    "task",
)
