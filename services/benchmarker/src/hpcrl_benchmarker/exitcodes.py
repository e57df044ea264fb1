"""Exit statuses that the sandboxed steps report to the pipeline, defined here and only here.

The compile step's shell script is written from ``CompileExit``; the C harness gets
``HarnessExit`` as ``-D`` definitions (``harness_defines``) and refuses to compile without
them, so the C, the shell and the Python that reads the statuses cannot disagree.
"""

from __future__ import annotations

from enum import IntEnum


class CompileExit(IntEnum):
    """Where the compile script stopped (0: compiled, read and linked)."""

    COMPILE_FAILED = 10  # gcc -c or gcc -E refused the kernel: diagnostics in the cc log
    OBJECT_UNREADABLE = 11  # readelf could not list the kernel's object
    LINK_FAILED = 12  # linking with the harness failed: diagnostics in ld.txt


class HarnessExit(IntEnum):
    """Why the harness ended before its END mark, when it says so itself."""

    WRITE_FAILED = 95  # a mark or C could not be written (the parent is gone, or a descriptor)
    SECCOMP_FAILED = 96  # the seccomp filter could not be installed
    OUT_OF_MEMORY = 97  # a buffer for a job could not be allocated
    BAD_INPUT = 98  # wrong arguments, descriptors or job line: the parent broke the protocol


# The harness's refusals to start: the benchmarker's fault, never the kernel's.
HARNESS_REFUSALS = frozenset({HarnessExit.SECCOMP_FAILED, HarnessExit.BAD_INPUT})


def harness_defines() -> list[str]:
    """``-DHARNESS_EXIT_<NAME>=<status>`` for every harness status, for its compiler."""
    return [f"-DHARNESS_EXIT_{status.name}={status.value}" for status in HarnessExit]
