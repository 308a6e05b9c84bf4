"""aioq: an asyncio-native background-job queue that lives in your PostgreSQL database."""

from aioq.admin import (
    QueueStats,
    Replay,
    Stats,
    TableStats,
    cancel_jobs,
    get_job,
    list_jobs,
    purge_dead,
    retry_dead,
    stats,
)
from aioq.errors import (
    AioqError,
    ArgumentError,
    ConfigError,
    DeferError,
    Fail,
    JobControl,
    OptionError,
    PayloadError,
    Retry,
    SchemaError,
    SerializationError,
    ServerError,
    TaskError,
    UnknownTaskError,
)
from aioq.job import Job, JobContext, JobStatus, current_job
from aioq.limits import QueueInfo, queues, set_queue
from aioq.migrate import install, schema_sql
from aioq.schedule import Schedule, periodic
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
    "OptionError",
    "PayloadError",
    "QueueInfo",
    "QueueStats",
    "Registry",
    "Replay",
    "Retry",
    "Schedule",
    "SchemaError",
    "SerializationError",
    "ServerError",
    "Stats",
    "TableStats",
    "Task",
    "TaskCall",
    "TaskError",
    "UnknownTaskError",
    "Worker",
    "WorkerConfig",
    "__version__",
    "cancel_jobs",
    "current_job",
    "default_registry",
    "get_job",
    "install",
    "list_jobs",
    "periodic",
    "purge_dead",
    "queues",
    "retry_dead",
    "schema_sql",
    "set_queue",
    "stats",
    "task",
)
