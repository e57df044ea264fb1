"""How a confirmation candidate names the measurement it re-checks (scheduler → benchmarker).

The scheduler re-measures a group's winner (``hpcrl_scheduler.confirm``) with an ordinary
``candidate/1`` whose ``generator`` field is ``confirm|<replica>|<host class>``: the replica
that measured the winner first and its host class. A benchmarker that is that replica, or
of another class, hands the candidate back on its first delivery so that another replica of
the class may take it; on a later delivery any replica measures it.
"""

from __future__ import annotations

PREFIX = "confirm|"
_MAX = 256  # Candidate.generator is ShortText


def label(replica: str, host_class: str) -> str:
    return f"{PREFIX}{replica}|{host_class}"[:_MAX]


def parse(generator: str) -> tuple[str, str] | None:
    """(replica, host class) a confirmation's ``generator`` names; None for a generator's."""
    if not generator.startswith(PREFIX):
        return None
    replica, _, host_class = generator[len(PREFIX) :].partition("|")
    return replica, host_class


def prefer_another(generator: str, replica: str, host_class: str, attempt: int) -> bool:
    """Whether this replica should hand the candidate back for another to measure."""
    named = parse(generator)
    return named is not None and attempt <= 1 and (named[0] == replica or named[1] != host_class)
