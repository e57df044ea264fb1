"""The failure statuses (docs/SPEC.md section 4): the one table of their penalties and repair
ranks, and the bounds every boundary holds numbers to.

Pure: no I/O. Everything that names a status takes it from :data:`FAILURES`: the wire
``Status`` of :mod:`hpcrl_common.messages`, :data:`FAILURE_REWARDS` here and the scheduler's
repair order (``hpcrl_scheduler.selection``). The benchmarker assigns rewards with
:func:`reward_for_status`; message validation uses the same function to refuse a result whose
reward does not follow from its status and GFLOPS, so a consumer (the scheduler) never trusts
the producer's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Failure:
    """One failure status: its raw reward, and where SQD repairs it (0 = repaired first)."""

    status: str
    penalty: float
    repair_rank: int
    description: str


# In the order the benchmarker checks them (when several apply, the first is reported). Most
# progressed is repaired first: the further a failed program got, the cheaper its repair.
FAILURES: tuple[Failure, ...] = (
    Failure("format_violation", -100.0, 6, "no function with the required signature found"),
    Failure("library_violation", -100.0, 5, "it calls a forbidden library or function (BLAS)"),
    # Treated like a library violation: the rules were broken.
    Failure("stage_violation", -100.0, 4, "it uses a technique its stage does not allow"),
    Failure("compile_error", -40.0, 3, "the extracted code fails to compile"),
    Failure("timeout", -30.0, 2, "it compiles but does not return within its time limit"),
    Failure("runtime_error", -20.0, 1, "it crashes (a segmentation fault, for instance)"),
    Failure("verification_error", -10.0, 0, "it returns, with a wrong result"),
)
SUCCESS = "success"
# Every status a result can carry, success first, then the table's order.
STATUS_NAMES: tuple[str, ...] = (SUCCESS, *(f.status for f in FAILURES))
FAILURE_REWARDS: dict[str, float] = {f.status: f.penalty for f in FAILURES}
REPAIR_RANKS: dict[str, int] = {f.status: f.repair_rank for f in FAILURES}

# No CPU node reaches a petaflop in double precision: a figure above it is forged or broken,
# whatever the host claims. Squares of numbers this size stay far from float overflow, so
# means and standard deviations of rewards cannot become inf or NaN.
MAX_GFLOPS = 1e6
MAX_ABS_REWARD = 1e6
# group_normalized successes reach the scheduler's success_scale (100 in the paper), at
# most this much (hpcrl_scheduler.groups).
MAX_SUCCESS_SCALE = 1_000.0
# parent_relative successes stop at 100x the parent (hpcrl_scheduler.groups).
MAX_PARENT_RELATIVE_REWARD = 9_900.0
# The rewards a rollout batch of each reward mode can hold (failures keep their penalty,
# the lowest -100): what the scheduler computes cannot leave them, so a batch outside is
# forged or broken.
LOWEST_PENALTY = min(FAILURE_REWARDS.values())
REWARD_RANGES: dict[str, tuple[float, float]] = {
    "raw": (LOWEST_PENALTY, MAX_GFLOPS),
    "group_normalized": (LOWEST_PENALTY, MAX_SUCCESS_SCALE),
    "parent_relative": (LOWEST_PENALTY, MAX_PARENT_RELATIVE_REWARD),
}


def reward_for_status(status: str, gflops: float | None) -> float:
    """Raw reward: GFLOPS for a success, the table's penalty otherwise."""
    if status == SUCCESS:
        if gflops is None:
            raise ValueError("a success needs its GFLOPS")
        return gflops
    return FAILURE_REWARDS[status]
