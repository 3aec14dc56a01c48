"""Log setup for every stage: ``text`` (one line, ``key=value`` fields) or ``json`` (one object).

A record's structured fields travel as ``extra=``: python-json-logger writes them as keys of
the JSON object, :class:`TextFormatter` appends them as ``key=value`` after the message.
"""

from __future__ import annotations

import logging
import os

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

_RESERVED = frozenset(RESERVED_ATTRS) | {"message", "asctime", "taskName"}


def extra_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields a call passed as ``extra=``."""
    return {k: v for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = extra_fields(record)
        if not fields:
            return line
        return line + " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items())


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in value.items())
    return "-" if value is None else str(value)


def setup_logging(stage: str, log_format: str = "text") -> None:
    """Root logging at ``MMCACHE_LOG_LEVEL`` (default INFO) in the given format."""
    level = os.environ.get("MMCACHE_LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                static_fields={"stage": stage},
                rename_fields={"levelname": "level", "name": "logger", "asctime": "time"},
            )
        )
    else:
        handler.setFormatter(TextFormatter(f"%(asctime)s {stage} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
