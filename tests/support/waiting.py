"""Polling until a condition holds: the one ``wait_for`` of the suites."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 20.0,
    what: str = "condition",
    detail: Callable[[], object] = lambda: "",
    every: float = 0.1,
) -> Any:
    """Call ``predicate`` every ``every`` seconds until it returns something truthy, and
    return that; after ``timeout`` seconds fail with ``what`` and ``detail()`` (logs, state)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    shown = detail()
    raise AssertionError(
        f"timed out after {timeout} s waiting for {what}" + (f": {shown}" if shown else "")
    )
