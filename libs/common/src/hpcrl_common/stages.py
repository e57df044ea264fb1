"""The stages of the SQD search (docs/SPEC.md, Table I): which techniques each stage allows."""

from __future__ import annotations

from dataclasses import dataclass

REGISTER_BLOCKING = "register_blocking"
CACHE_BLOCKING = "cache_blocking"
SIMD = "simd"
OPENMP = "openmp"
PREFETCH = "prefetch"
TECHNIQUES = (REGISTER_BLOCKING, CACHE_BLOCKING, SIMD, OPENMP, PREFETCH)
# Only these can be detected reliably in source; blocking is allowed from stage 1/2 anyway.
POLICED = (SIMD, OPENMP, PREFETCH)


@dataclass(frozen=True)
class Stage:
    number: int
    allowed: tuple[str, ...]

    @property
    def forbidden(self) -> tuple[str, ...]:
        return tuple(t for t in POLICED if t not in self.allowed)

    def violations(self, detected: set[str] | frozenset[str]) -> list[str]:
        return [t for t in self.forbidden if t in detected]


STAGES: dict[int, Stage] = {
    1: Stage(1, (REGISTER_BLOCKING,)),
    2: Stage(2, (REGISTER_BLOCKING, CACHE_BLOCKING)),
    3: Stage(3, (REGISTER_BLOCKING, CACHE_BLOCKING, SIMD)),
    4: Stage(4, (REGISTER_BLOCKING, CACHE_BLOCKING, SIMD, OPENMP)),
    5: Stage(5, TECHNIQUES),
    6: Stage(6, TECHNIQUES),
}
FIRST_STAGE, LAST_STAGE = min(STAGES), max(STAGES)


def stage(number: int) -> Stage:
    try:
        return STAGES[number]
    except KeyError:
        raise ValueError(f"stage must be {FIRST_STAGE}..{LAST_STAGE}, got {number}") from None
