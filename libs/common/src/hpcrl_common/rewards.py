"""The reward table (docs/SPEC.md section 4) and the bounds every boundary holds numbers to.

Pure: no I/O. The benchmarker assigns rewards with :func:`reward_for_status`; message
validation uses the same function to refuse a result whose reward does not follow from its
status and GFLOPS, so a consumer (the scheduler) never trusts the producer's arithmetic.
"""

from __future__ import annotations

FAILURE_REWARDS: dict[str, float] = {
    "format_violation": -100.0,
    "library_violation": -100.0,
    "stage_violation": -100.0,  # treated like a library violation: the rules were broken
    "compile_error": -40.0,
    "timeout": -30.0,
    "runtime_error": -20.0,
    "verification_error": -10.0,
}

# No CPU node reaches a petaflop in double precision: a figure above it is forged or broken,
# whatever the host claims. Squares of numbers this size stay far from float overflow, so
# means and standard deviations of rewards cannot become inf or NaN.
MAX_GFLOPS = 1e6
MAX_ABS_REWARD = 1e6
# parent_relative successes stop at 100x the parent (hpcrl_scheduler.groups).
MAX_PARENT_RELATIVE_REWARD = 9_900.0
# The rewards a rollout batch of each reward mode can hold (failures keep their penalty,
# the lowest -100): what the scheduler computes cannot leave them, so a batch outside is
# forged or broken.
REWARD_RANGES: dict[str, tuple[float, float]] = {
    "raw": (-100.0, MAX_GFLOPS),
    "group_normalized": (-100.0, 100.0),
    "parent_relative": (-100.0, MAX_PARENT_RELATIVE_REWARD),
}


def reward_for_status(status: str, gflops: float | None) -> float:
    """Raw reward: GFLOPS for a success, the table's penalty otherwise."""
    if status == "success":
        if gflops is None:
            raise ValueError("a success needs its GFLOPS")
        return gflops
    return FAILURE_REWARDS[status]
