"""What machine this is: CPU model, ISA, compiler, theoretical peak and the host class.

Rewards are only comparable between measurements taken on the same class of host, so the
class is derived from exactly what changes a kernel's speed or code: CPU model, ISA flags and
compiler version (not the hostname or the core count of a particular VM).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hpcrl_common.messages import HostInfo
from hpcrl_common.rewards import MAX_GFLOPS

# The ISA flags that decide which kernels compile and how fast they can be.
ISA_FLAGS = ("avx512f", "avx512dq", "avx512bw", "avx512vl", "avx2", "fma", "avx", "sse4_2")
# Double-precision FLOPs per cycle per core, as an upper bound: two FMA ports of the widest
# vector the ISA has (8 doubles for AVX-512, 4 for AVX2, 2 for SSE), 2 FLOPs per FMA.
_FLOPS_PER_CYCLE = (("avx512f", 32), ("avx2", 16), ("avx", 16), ("sse2", 8))
# /proc/cpuinfo MHz is the current (or a VM's nominal) clock; turbo can exceed it. The peak
# used to reject impossible measurements must be an upper bound, so it is inflated by this.
CLOCK_SAFETY_FACTOR = 1.5
DEFAULT_REQUIRED_ISA = "avx512f"


class IsaRefused(RuntimeError):
    pass


@dataclass(frozen=True)
class HostProfile:
    hostname: str
    cpu_model: str
    flags: frozenset[str]
    cores: int
    max_mhz: float
    compiler: str

    @property
    def isa(self) -> list[str]:
        return [flag for flag in ISA_FLAGS if flag in self.flags]

    @property
    def best_isa(self) -> str:
        for flag in ("avx512f", "avx2", "avx"):
            if flag in self.flags:
                return flag
        return "sse2"

    @property
    def prompt_isa(self) -> str:
        """The ISA name prompts use for this host: avx512 (with AVX-512F) or avx2."""
        return "avx512" if "avx512f" in self.flags else "avx2"

    @property
    def flops_per_cycle(self) -> int:
        for flag, flops in _FLOPS_PER_CYCLE:
            if flag in self.flags:
                return flops
        return 4

    @property
    def peak_gflops(self) -> float:
        """cores x clock x DP FLOPs/cycle, with the clock inflated to an upper bound."""
        return self.cores * self.max_mhz * 1e-3 * CLOCK_SAFETY_FACTOR * self.flops_per_cycle

    @property
    def host_class(self) -> str:
        key = "|".join([self.cpu_model, ",".join(self.isa), self.compiler])
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        model = re.sub(r"[^a-z0-9]+", "-", self.cpu_model.lower()).strip("-")[:80]
        return f"{model}/{self.best_isa}/{_short_compiler(self.compiler)}/{digest}"

    def info(self) -> HostInfo:
        return HostInfo(
            hostname=self.hostname[:256],
            cpu_model=self.cpu_model[:256],
            isa=self.isa,
            cores=self.cores,
            compiler=self.compiler[:256],
            host_class=self.host_class,
            peak_gflops=min(self.peak_gflops, MAX_GFLOPS),
        )

    def check_isa(self, allow: list[str] | tuple[str, ...] = ()) -> None:
        """Refuse hosts without AVX-512 unless the operator allowed the ISA they do have."""
        if DEFAULT_REQUIRED_ISA in self.flags:
            return
        usable = [isa for isa in allow if isa in self.flags]
        if usable:
            return
        have = ", ".join(self.isa) or "none of " + ", ".join(ISA_FLAGS)
        raise IsaRefused(
            f"this host has no {DEFAULT_REQUIRED_ISA} (it has: {have}); rewards measured here "
            "would not be comparable with AVX-512 hosts. To run anyway (development, CI), allow "
            'an ISA this host has with --allow-isa avx2 or benchmarker.allow_isa = ["avx2"]'
        )


def _short_compiler(compiler: str) -> str:
    match = re.search(r"(\d+\.\d+(\.\d+)?)", compiler)
    name = compiler.split()[0] if compiler else "cc"
    return f"{name}{match.group(1) if match else ''}"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str], float]:
    model, flags, mhz = "unknown", frozenset[str](), 0.0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and model == "unknown":
            model = value
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        elif key == "cpu MHz":
            with contextlib.suppress(ValueError):
                mhz = max(mhz, float(value))
    return model, flags, mhz


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (none where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return parse_cpuinfo(text)[1]


def has_avx512() -> bool:
    """AVX-512F: the ISA rewards are measured in unless a host is allowed another one."""
    return DEFAULT_REQUIRED_ISA in cpu_flags()


def openblas_coretype() -> str | None:
    """The OpenBLAS kernels for this CPU's ISA (``OPENBLAS_CORETYPE``), or None to let it
    detect. OpenBLAS 0.3.21 detects by CPU model, and falls back to old kernels where a VM
    hides the model (Prescott on a masked Xeon, 5x slower) or it does not know the model
    (Haswell's AVX2 kernels on an AVX-512 EPYC); the flags are what the CPU really runs."""
    flags = cpu_flags()
    if has_avx512():
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


# glibc's mallopt parameters and the values set: blocks up to 32 MiB (every matrix of a
# job at the task sizes) come from the heap, and up to 256 MiB of freed heap stays mapped.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 32 << 20, 256 << 20


@functools.cache
def reuse_freed_memory() -> bool:
    """Keep this process's freed memory mapped for the next allocation (glibc's malloc; a
    no-op elsewhere). By default every block over 128 KiB is a fresh mapping returned to the
    system when freed, so each job's inputs, references and results (~1 MB arrays) faulted
    their pages in again: ~2,300 page faults and ~4 ms per candidate, beside its compile."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
            and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):
        return False


def _cpufreq_max_mhz() -> float:
    best = 0.0
    for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/cpuinfo_max_freq"):
        try:
            best = max(best, int(path.read_text().strip()) / 1000.0)
        except (OSError, ValueError):
            continue
    return best


def compiler_version(compiler: str = "gcc") -> str:
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()[0].strip()


_PROFILE: dict[str, HostProfile] = {}


def detect(compiler: str = "gcc") -> HostProfile:
    if compiler not in _PROFILE:
        model, flags, mhz = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
        # A VM may report no or a low clock: never let the bound fall below 4 GHz nominal.
        max_mhz = max(mhz, _cpufreq_max_mhz(), 4000.0)
        _PROFILE[compiler] = HostProfile(
            hostname=socket.gethostname(),
            cpu_model=model,
            flags=flags,
            cores=len(os.sched_getaffinity(0)),
            max_mhz=max_mhz,
            compiler=compiler_version(compiler),
        )
    return _PROFILE[compiler]
