"""The verdict on one candidate; its reward follows the table in hpcrl_common.rewards."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from hpcrl_common.messages import HostInfo, Timing
from hpcrl_common.rewards import reward_for_status


def timing_stats(runs_s: list[float]) -> Timing:
    mean = statistics.fmean(runs_s)
    cv = statistics.pstdev(runs_s) / mean if len(runs_s) > 1 else 0.0
    return Timing(
        runs_s=runs_s,
        mean_s=mean,
        median_s=statistics.median(runs_s),
        min_s=min(runs_s),
        max_s=max(runs_s),
        cv=cv,
    )


@dataclass
class Verdict:
    status: str
    host: HostInfo
    gflops: float | None = None
    timing: Timing | None = None
    techniques: list[str] = field(default_factory=list)
    generalizes: bool | None = None
    error: str = ""
    source: str | None = None
    compile_flags: list[str] = field(default_factory=list)
    durations_s: dict[str, float] = field(default_factory=dict)

    @property
    def reward(self) -> float:
        return reward_for_status(self.status, self.gflops)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["reward"] = self.reward
        data["host"] = self.host.model_dump()
        data["timing"] = self.timing.model_dump() if self.timing else None
        return data
