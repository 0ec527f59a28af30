"""Log lines (server/observability.py): the faster formatter writes the standard text."""

from __future__ import annotations

import io
import logging

import pytest

from portico.server.observability import LOG_FORMAT, LineFormatter, configure_logging


def record_at(created: float) -> logging.LogRecord:
    record = logging.LogRecord(
        "portico.core", logging.INFO, __file__, 1, "turn ended %s", ("t1",), None
    )
    record.created = created
    record.msecs = (created - int(created)) * 1000
    return record


# Across second boundaries, in order and out of order (a line from another thread).
TIMES = [1_800_000_000.0, 1_800_000_000.999, 1_800_000_001.0, 1_800_000_000.5, 1_800_003_600.042]


@pytest.mark.parametrize("times", [TIMES, list(reversed(TIMES))])
def test_each_line_is_the_standard_formatters_text(times: list[float]) -> None:
    standard, ours = logging.Formatter(LOG_FORMAT), LineFormatter()
    for created in times:
        record = record_at(created)
        assert ours.format(record) == standard.format(record)


def test_configured_logging_writes_lines_in_the_format(monkeypatch: pytest.MonkeyPatch) -> None:
    # configure_logging sets these process-wide: put them back for the other tests.
    for flag in ("_srcfile", "logThreads", "logProcesses", "logMultiprocessing"):
        monkeypatch.setattr(logging, flag, getattr(logging, flag))
    configure_logging("INFO")
    try:
        (handler,) = logging.getLogger().handlers
        assert isinstance(handler, logging.StreamHandler)
        stream = io.StringIO()
        handler.setStream(stream)
        logging.getLogger("portico.test").info("hello %s", "there")
        logging.getLogger("portico.test").debug("not shown")
        (line,) = stream.getvalue().splitlines()
        date, clock, level, name, *message = line.split(" ")
        assert (level, name, message) == ("INFO", "portico.test", ["hello", "there"])
        assert (len(date), len(clock), clock[8]) == (10, 12, ",")
    finally:
        logging.basicConfig(force=True)
