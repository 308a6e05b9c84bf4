"""Log formatting for the command line: ``--log-format text|json``.

The library only logs (``logging.getLogger("aioq...")``); handlers and formatters are set up
by the CLI alone, with :func:`formatter`.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

__all__ = ("EXTRA_KEYS", "JsonFormatter", "formatter")

EXTRA_KEYS = ("job_id", "task", "queue", "attempt", "duration_s", "outcome")
"""The ``extra`` keys of aioq's job log lines, copied into JSON records when present."""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


class JsonFormatter(logging.Formatter):
    """Format each record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        """Return the record as a JSON object: time, level, logger, message, job extras."""
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        for key in EXTRA_KEYS:
            if key in record.__dict__:
                out[key] = record.__dict__[key]
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def formatter(kind: str) -> logging.Formatter:
    """Return the formatter for ``--log-format`` (``text`` or ``json``)."""
    if kind == "json":
        return JsonFormatter()
    if kind == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"unknown log format {kind!r}; use text or json")
