"""The JSON log formatter keeps every ``extra`` of a record, not only the job keys."""

from __future__ import annotations

import json
import logging
import sys

from aioq.logs import JsonFormatter, formatter


def _record(**extra: object) -> logging.LogRecord:
    logger = logging.getLogger("aioq.test")
    return logger.makeRecord(
        logger.name, logging.INFO, __file__, 1, "reaped %d", (3,), None, extra=extra
    )


def test_json_keeps_every_extra_and_no_standard_attribute() -> None:
    record = _record(rescued=3, archived=5, dead_tuples=7, job_id=42, custom={"a": [1]})
    out = json.loads(JsonFormatter().format(record))
    assert out.pop("time")
    assert out == {
        "level": "INFO",
        "logger": "aioq.test",
        "message": "reaped 3",
        "process": record.process,
        "rescued": 3,
        "archived": 5,
        "dead_tuples": 7,
        "job_id": 42,
        "custom": {"a": [1]},
    }


def test_json_extras_that_are_not_json_are_written_as_text_and_never_hide_fields() -> None:
    record = _record(when=object, level="mine", time="mine")
    out = json.loads(formatter("json").format(record))
    assert out["when"] == str(object)
    assert out["level"] == "INFO"  # the record's own fields win over an extra of that name
    assert out["time"] != "mine"


def test_json_exception_is_kept() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("aioq.test").makeRecord(
            "aioq.test", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    out = json.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in out["exception"]
    assert "exc_info" not in out
    assert "exc_text" not in out
