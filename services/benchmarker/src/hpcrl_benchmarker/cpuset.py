"""The CPUs a replica owns (``benchmarker.cpus``): parsing and checking a CPU list.

The timing locks that go with a set are in ``timinglock``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

# Linux's own upper bound on CPU numbers (CONFIG_NR_CPUS max): a larger number is a typo.
MAX_CPU = 8191
_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def parse(text: str) -> tuple[int, ...]:
    """A CPU list as taskset and /sys write it ('0-3', '0,2', '0-3,8-11') -> the CPUs,
    ascending and without repeats; '' -> () (no set: every CPU the process may use)."""
    text = text.strip()
    if not text:
        return ()
    cpus: set[int] = set()
    for raw in text.split(","):
        item = raw.strip()
        match = _ITEM.fullmatch(item)
        if match is None:
            raise ValueError(
                f"bad CPU list {text!r}: {item!r} is not a CPU number or a "
                f"range A-B (e.g. '0-3' or '0,2')"
            )
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if last < first:
            raise ValueError(f"bad CPU list {text!r}: the range {item!r} runs backwards")
        if last > MAX_CPU:
            raise ValueError(f"bad CPU list {text!r}: CPU {last} is above {MAX_CPU}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def text(cpus: Iterable[int]) -> str:
    """The compact form of a CPU set: (0, 1, 2, 5) -> '0-2,5'."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def check_allowed(cpus: Sequence[int], allowed: Iterable[int]) -> None:
    """Refuse a set that names CPUs this process may not run on (taskset would fail on each
    run, or the replica would claim CPUs that someone else was given)."""
    allowed = set(allowed)
    if outside := sorted(set(cpus) - allowed):
        raise ValueError(
            f"benchmarker.cpus {text(cpus)!r} names CPU(s) {text(outside)} "
            f"outside this process's affinity {text(allowed)}"
        )
