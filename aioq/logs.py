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
"""The stable ``extra`` keys of aioq's job log lines (every other ``extra`` is kept too)."""

# What every LogRecord carries; anything else on a record came from ``extra`` and is kept.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


class JsonFormatter(logging.Formatter):
    """Format each record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        """Return the record as a JSON object: time, level, logger, message, and every extra."""
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out.setdefault(key, value)  # an extra never hides the record's own fields
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
