"""The theoretical peak of each host class, as the scheduler knows it: never from one message.

A result's GFLOPS are refused above its host class's peak (``Scheduler.handle_result``). A
``bench-result`` carries its host's ``peak_gflops`` and the message schema checks the GFLOPS
against it, but a benchmarker credential writes both: a forged success of 5,000 GFLOPS
"measured" on a host claiming a peak of 1e6 passed. So the scheduler keeps its own peak per
host class (``HostInfo.host_class``: CPU model, ISA flags and compiler, hashed, as the
benchmarker derives it), decided in this order:

1. the operator's registry, ``scheduler.host_peaks`` (key: the host class, or the CPU model
   for every class of that model): it wins over anything a message says;
2. otherwise the lowest peak any result of the class has reported, never raised by a later
   message (hosts of one class share the CPU model; a lower figure only makes the bound
   stricter), and never above the **formula**: reported cores x ``scheduler.max_clock_ghz``
   x the double-precision FLOPs per cycle of the widest ISA reported (32 for AVX-512F, 16
   for AVX2/AVX, 8 otherwise), with the cores counted at most ``scheduler.max_host_cores``.

So a forged peak can only lower a class's bound. A class seen for the first time in a forged
message gets the formula's bound for what it claims, and its results are still alone in
their class (a group keeps only its majority class) and re-measured before they win
(``scheduler.confirm_winners``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl_common.messages import BenchResult, HostInfo

if TYPE_CHECKING:
    from hpcrl_scheduler.store import Store

# Double-precision FLOPs per cycle per core: two FMA ports of the widest vector (the
# benchmarker's host.py uses the same table for its own bound).
FLOPS_PER_CYCLE = (("avx512f", 32), ("avx2", 16), ("avx", 16))
OTHER_FLOPS_PER_CYCLE = 8
_KEY_PREFIX = "host_peak/"


def formula_peak(host: HostInfo, *, max_clock_ghz: float, max_cores: int) -> float:
    flops = next((f for isa, f in FLOPS_PER_CYCLE if isa in host.isa), OTHER_FLOPS_PER_CYCLE)
    return min(host.cores, max_cores) * max_clock_ghz * flops


@dataclass(frozen=True)
class PeakBound:
    gflops: float
    source: str  # "registry", "seen" or "formula"


class PeakBook:
    """Per host class peaks, kept in the scheduler's store (``meta`` rows)."""

    def __init__(
        self, registry: Mapping[str, float], *, max_clock_ghz: float, max_cores: int
    ) -> None:
        self.registry = dict(registry)
        self.max_clock_ghz = max_clock_ghz
        self.max_cores = max_cores

    def bound(self, store: Store, host: HostInfo) -> PeakBound:
        """The class's peak as known before this host's report is taken into account."""
        for key in (host.host_class, host.cpu_model):
            if key in self.registry:
                return PeakBound(self.registry[key], "registry")
        formula = formula_peak(host, max_clock_ghz=self.max_clock_ghz, max_cores=self.max_cores)
        seen = store.get(_KEY_PREFIX + host.host_class)
        if seen is not None:
            return PeakBound(min(float(seen), formula), "seen")
        return PeakBound(min(host.peak_gflops, formula), "formula")

    def admit(self, store: Store, result: BenchResult) -> str | None:
        """None if the result's GFLOPS are within its class's peak (and the class's peak is
        then lowered to this host's report if that is lower); else why it is refused."""
        host = result.host
        bound = self.bound(store, host)
        if result.gflops is not None and result.gflops > bound.gflops:
            return (
                f"gflops {result.gflops:g} is above the peak of host class "
                f"{host.host_class!r}, {bound.gflops:g} GFLOPS ({bound.source}; the "
                f"result claims {host.peak_gflops:g})"
            )
        if bound.source != "registry":
            key = _KEY_PREFIX + host.host_class
            seen = store.get(key)
            lowest = min(host.peak_gflops, bound.gflops)
            if seen is None or lowest < float(seen):
                store.set(key, lowest)
        return None
