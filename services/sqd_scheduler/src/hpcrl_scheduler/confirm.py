"""Winners are re-measured before they count (BOINC-style replication and validation).

When a group is ready to close, its best success (the group's maximum, so also every
candidate for the run's best) is sent to ``code-to-bench`` again as a *confirmation*: a
candidate of its own (group ``<group id>.confirm<round>``, index 0, no token data) whose
completion is **the text the generator committed to** for the winner's candidate (its
``candidate-commitment/2``, kept in the store until the group closes:
:mod:`hpcrl_scheduler.commitments`), not the source the first benchmarker reported, and
whose ``generator`` field names the replica and host class of
the first measurement (``confirm|<replica>|<host class>``, :mod:`hpcrl_common.confirmation`).
The confirming replica extracts and compiles that text itself. Extraction is deterministic,
so its ``source`` must be the first result's, character for character: a first result that
reports another source (a fast kernel from elsewhere, reported against a slow candidate
whose genuine tokens would then be trained at the top reward) is a disagreement, whatever
the two timings say.
A benchmarker hands such a candidate back once when it is the replica named, or of another
class, so that another host of the class measures it where one exists; on its second
delivery any replica measures it (a single replica then times it a second time: a real
second measurement, not a replay).

The group stays open (its rewards, pool children and rollout batch wait) until the answer:

* **agreed**: same host class, a success, and the winner's GFLOPS at most
  ``(1 + confirm_tolerance)`` x the second measurement's: the winner counts at the *lower*
  of its two measurements (so no inflated claim survives, within the tolerance or not), the
  group's other successes count at most that much (each measured once, none may beat a
  confirmed winner), and the group closes; except that a success measured once *above* the
  confirmed winner's lower measurement would count there too, tied with it although the
  group's own timings ranked them (on a busy node the lower measurement erased the winner's
  lead in 35-52 % of groups): while ``confirm_rounds`` last, the fastest such success is
  measured again in turn and counts at its own lower measurement (no committed text, no
  answer in time or no rounds left: at the winner's, as before), so near-ties are settled
  by like measurements and nothing counts above a figure measured twice;
* **disagreed**: the committed text yields another source than the one reported (or no
  kernel at all: ``format_violation``), a failure, or GFLOPS that far below the claim: the
  winner is dropped from
  the group (no reward, not in the pool or the batch), both results and the reporting host
  are marked suspect (``hpcrl_scheduler_suspect_results_total``, a warning in the log, the
  host under ``suspect_hosts`` in ``/healthz``), and the group's next best is confirmed in
  turn (at most ``confirm_rounds`` re-measurements per group);
* **inconclusive**: measured on another host class (not comparable; a source that differs
  is a disagreement on any class: extraction does not depend on the host), a success that
  reports no source to compare (a confirmer with ``include_source = false``), or confirmed
  by the
  broker user (``user_id``) that sent the winner while another user has sent results of
  the class (a benchmarker credential also reads ``code-to-bench``, and must not confirm
  its own claim where another site could): another round. Where one user holds every host
  of the class, its own second measurement is all there is, and is taken.

The tolerance only decides what is *suspect*: between two processes on a busy 2-core node
the same kernel's GFLOPS differ by up to 2x (``bench/confirm_cost.py`` saw 0.92 against
0.46), so the default (2.0: a claim over 3x the second measurement) marks no honest host of
such a node, while the lower-measurement rule already takes any gain from a smaller lie.

A winner whose candidate has no committed text (its commitment was a
``candidate-commitment/1``, of a generator of an older release; or none came: a result
without token data is not checked against commitments) is dropped unconfirmed
(``no_text``) and its successor confirmed, like one without its source; with
``scheduler.require_committed_text = false`` (a rolling upgrade) it is re-measured from the
source it reports instead, as before commitments carried text (``reported_source``), and
that source is not compared.

Where a winner is confirmed from its committed text, the pool keeps the confirmer's source
for it: the two are the same text, since any difference is a disagreement.

A confirmation that does not come within ``group_deadline_s`` drops the winner unconfirmed
(and the group closes); so does running out of rounds while the winner is still unconfirmed
after a disagreement. A group whose winner cannot be confirmed for want of its source
(``benchmarker.include_source = false``) closes unconfirmed, counted.

State lives in the store's ``meta`` rows (``confirm/<group>`` and ``confirming/<confirmation
group>``), written in the same transaction as the outbox row of the confirmation, so a kill
-9 at any point neither loses nor repeats one.
"""

from __future__ import annotations

import hashlib
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
    # Whether the confirmation in flight measures the committed text (so its source must be
    # the winner's), or the source the winner reports (no committed text).
    from_text: bool = False
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


def confirmation(
    winner: BenchResult,
    group_id: str,
    round_: int,
    text: str | None = None,
    *,
    task: str | None = None,
) -> Candidate:
    """The candidate that re-measures ``winner``: the generator's committed ``text`` of its
    candidate, or (None) the source the winner reports (then set). ``task``: its group's
    task, which it is judged as again (None: the task the winner reports)."""
    if text is None:
        assert winner.source is not None
        text = f"```c\n{winner.source}\n```\n"
    group = confirm_group_id(group_id, round_)
    return Candidate(
        id=candidate_id(group, 0),
        group_id=group,
        index=0,
        completion=text,
        bench=winner.bench if task is None else winner.bench.model_copy(update={"task": task}),
        generator=label.label(winner.benchmarker, winner.host.host_class),
    )


def judge(
    first: BenchResult, second: BenchResult, tolerance: float, *, from_text: bool = False
) -> tuple[Verdict, str]:
    """Whether ``second`` confirms ``first`` (a success), and why not. ``from_text``:
    ``second`` measured the committed text of ``first``'s candidate, so the source it
    extracted must be the one ``first`` reports."""
    if from_text:
        claim = f"{first.gflops:g} GFLOPS claimed"
        if second.source is not None and second.source != first.source:
            return "disagreed", (
                f"{claim} for a source that is not what the committed text yields: measured "
                f"again, the text gave {_describe(second.source)}, the result reported "
                f"{_describe(first.source)}"
            )
        if second.status == "format_violation":
            return "disagreed", (
                f"{claim} for a source, but the committed text measured again yields no "
                f"kernel (format_violation: {second.error[:200]})"
            )
        if second.status == "success" and second.source is None:
            return "inconclusive", (
                "the second measurement reports no source to compare with the committed text's"
            )
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


def _describe(source: str | None) -> str:
    if source is None:
        return "no source"
    digest = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{len(source)} characters (sha256 {digest[:12]}…)"


def host_key(result: BenchResult) -> str:
    """How a suspect host is named: hostname and replica (what the operator can find)."""
    return f"{result.host.hostname}/{result.benchmarker or '?'}"
