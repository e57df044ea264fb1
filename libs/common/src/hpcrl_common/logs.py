"""structlog set-up shared by every service: JSON off a terminal, readable on one."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is now, not what it was at configuration time
    (test runners and daemons swap it; a captured, since-closed stream must not be kept)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(
    service: str,
    level: str = "info",
    fmt: Literal["auto", "json", "console"] = "auto",
) -> structlog.stdlib.BoundLogger:
    """Configure structlog (and stdlib logging, so pika's messages share the format)."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer]
        if use_json
        else [*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=max(_LEVELS[level], logging.WARNING),
        stream=_CurrentStderr(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger(service)
