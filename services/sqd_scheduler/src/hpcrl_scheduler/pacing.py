"""Admission control: how far generation may run ahead of learning.

The learner reports, with every weight update, how many groups it has trained on in total
(``groups_trained``, here including those it dropped as stale: they are done too) and how
many it takes per step (``groups_per_step``). A group is "outstanding" from the moment its
request is published until the learner has trained on (or dropped) it:
outstanding = rollout batches published + groups in flight - groups trained. New requests are
held while outstanding >= max_staleness x groups_per_step, which keeps the policy that sampled
a batch at most about ``max_staleness`` versions behind the learner. Counting groups in flight
(not only published batches) is what stops a whole iteration from being requested at once.

Before the first update ``groups_trained`` is 0 and ``groups_per_step`` is the configured
``initial_groups_per_step`` (checked equal to the learner's ``groups_per_step`` when a config
loads); the limit is never below 1, so iteration 0's first group is always admitted.
``max_staleness = 0`` turns this off (no learner in the loop).
``max_groups_in_flight`` bounds the groups in flight in any case.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PacingState:
    batches_published: int
    groups_in_flight: int
    groups_trained: int
    groups_per_step: int


def outstanding(state: PacingState) -> int:
    return max(0, state.batches_published + state.groups_in_flight - state.groups_trained)


def hold_reason(state: PacingState, *, max_staleness: int, max_groups_in_flight: int) -> str | None:
    """Why the next request must wait ("in_flight", "staleness"), or None to admit it."""
    if max_groups_in_flight > 0 and state.groups_in_flight >= max_groups_in_flight:
        return "in_flight"
    if max_staleness > 0:
        limit = max(1, max_staleness * max(1, state.groups_per_step))
        if outstanding(state) >= limit:
            return "staleness"
    return None
