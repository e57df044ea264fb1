"""Winners are re-measured before they count (BOINC-style replication and validation).

When a group is ready to close, its best success (the group's maximum, so also every
candidate for the run's best) is sent to ``code-to-bench`` again as a *confirmation*: a
candidate of its own (group ``<group id>.confirm<round>``, index 0, the winner's source as
the completion, no token data) whose ``generator`` field names the replica and host class of
the first measurement (``confirm|<replica>|<host class>``, :mod:`hpcrl_common.confirmation`).
A benchmarker hands such a candidate back once when it is the replica named, or of another
class, so that another host of the class measures it where one exists; on its second
delivery any replica measures it (a single replica then times it a second time: a real
second measurement, not a replay).

The group stays open (its rewards, pool children and rollout batch wait) until the answer:

* **agreed**: same host class, a success, and the winner's GFLOPS at most
  ``(1 + confirm_tolerance)`` x the second measurement's: the winner counts at the *lower*
  of its two measurements (so no inflated claim survives, within the tolerance or not), the
  group's other successes count at most that much (each measured once, none may beat a
  confirmed winner: so one confirmation per group, not one per near-tie), and the group
  closes;
* **disagreed**: a failure, or GFLOPS that far below the claim: the winner is dropped from
  the group (no reward, not in the pool or the batch), both results and the reporting host
  are marked suspect (``hpcrl_scheduler_suspect_results_total``, a warning in the log, the
  host under ``suspect_hosts`` in ``/healthz``), and the group's next best is confirmed in
  turn (at most ``confirm_rounds`` re-measurements per group);
* **inconclusive**: measured on another host class (not comparable), or confirmed by the
  broker user (``user_id``) that sent the winner while another user has sent results of
  the class (a benchmarker credential also reads ``code-to-bench``, and must not confirm
  its own claim where another site could): another round. Where one user holds every host
  of the class, its own second measurement is all there is, and is taken.

The tolerance only decides what is *suspect*: between two processes on a busy 2-core node
the same kernel's GFLOPS differ by up to 2x (``bench/confirm_cost.py`` saw 0.92 against
0.46), so the default (2.0: a claim over 3x the second measurement) marks no honest host of
such a node, while the lower-measurement rule already takes any gain from a smaller lie.

A confirmation that does not come within ``group_deadline_s`` drops the winner unconfirmed
(and the group closes); so does running out of rounds while the winner is still unconfirmed
after a disagreement. A group whose winner cannot be confirmed for want of its source
(``benchmarker.include_source = false``) closes unconfirmed, counted.

State lives in the store's ``meta`` rows (``confirm/<group>`` and ``confirming/<confirmation
group>``), written in the same transaction as the outbox row of the confirmation, so a kill
-9 at any point neither loses nor repeats one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hpcrl_common import confirmation as label
from hpcrl_common.messages import BenchResult, Candidate, candidate_id

Verdict = Literal["agreed", "disagreed", "inconclusive"]
STATE_PREFIX = "confirm/"
INDEX_PREFIX = "confirming/"
SUSPECTS_KEY = "suspect_hosts"
PUBLISHER_PREFIX = "publisher/"  # result id -> the broker user that sent it
CLASS_USERS_PREFIX = "class_users/"  # host class -> broker users that sent its results
MAX_CLASS_USERS = 64
MAX_SUSPECT_HOSTS = 100


@dataclass
class ConfirmState:
    round: int = 0
    waiting: str | None = None  # the result id being confirmed
    confirm_group: str = ""  # the group id of the confirmation candidate in flight
    reason: str = "complete"  # why the group was closing when the round was issued
    confirmed: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    adjusted: dict[str, float] = field(default_factory=dict)  # id -> the lower measurement

    @classmethod
    def of(cls, value: dict[str, Any] | None) -> ConfirmState:
        return cls(**value) if value else cls()

    @property
    def ceiling(self) -> float | None:
        """The confirmed winner's GFLOPS (its lower measurement), once there is one."""
        return max(self.adjusted.values()) if self.adjusted else None

    def apply(self, results: list[BenchResult]) -> list[BenchResult]:
        """``results`` less those dropped; the confirmed winner at its lower measurement and
        no other success above it."""
        kept = []
        ceiling = self.ceiling
        for result in results:
            if result.id in self.dropped:
                continue
            gflops = self.adjusted.get(result.id, result.gflops)
            if ceiling is not None and gflops is not None:
                gflops = min(gflops, ceiling)
            if gflops != result.gflops:
                result = result.model_copy(update={"gflops": gflops, "reward": gflops})
            kept.append(result)
        return kept

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def confirm_group_id(group_id: str, round_: int) -> str:
    return f"{group_id}.confirm{round_}"


def confirmation(winner: BenchResult, group_id: str, round_: int) -> Candidate:
    """The candidate that re-measures ``winner`` (whose ``source`` is set)."""
    assert winner.source is not None
    group = confirm_group_id(group_id, round_)
    return Candidate(
        id=candidate_id(group, 0),
        group_id=group,
        index=0,
        completion=f"```c\n{winner.source}\n```\n",
        bench=winner.bench,
        generator=label.label(winner.benchmarker, winner.host.host_class),
    )


def judge(first: BenchResult, second: BenchResult, tolerance: float) -> tuple[Verdict, str]:
    """Whether ``second`` confirms ``first`` (a success), and why not."""
    if second.host.host_class != first.host.host_class:
        return "inconclusive", (
            f"measured on host class {second.host.host_class!r}, not {first.host.host_class!r}"
        )
    if second.status != "success" or second.gflops is None:
        return "disagreed", f"the second measurement is {second.status}: {second.error[:200]}"
    assert first.gflops is not None
    if first.gflops > second.gflops * (1.0 + tolerance):
        return "disagreed", (
            f"{first.gflops:g} GFLOPS claimed, {second.gflops:g} measured "
            f"again (beyond the tolerance {tolerance:g})"
        )
    return "agreed", f"{first.gflops:g} GFLOPS claimed, {second.gflops:g} measured again"


def host_key(result: BenchResult) -> str:
    """How a suspect host is named: hostname and replica (what the operator can find)."""
    return f"{result.host.hostname}/{result.benchmarker or '?'}"
