"""The verifier's OpenBLAS runs the kernels of the host's ISA, not a detection fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpcrl_benchmarker import host

_CORENAME = """
import ctypes
from hpcrl_benchmarker import gemm
name = gemm._openblas().openblas_get_corename
name.restype = ctypes.c_char_p
print(name().decode())
"""


def _corename(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _CORENAME],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout.strip()


def test_the_coretype_follows_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    for flags, expected in (
        (frozenset({"avx512f", "avx2", "fma"}), "SkylakeX"),
        (frozenset({"avx2", "fma"}), "Haswell"),
        (frozenset({"sse4_2"}), None),
    ):
        monkeypatch.setattr(host, "cpu_flags", lambda flags=flags: flags)
        assert host.openblas_coretype() == expected


def test_the_verifier_loads_the_kernels_of_the_host_isa() -> None:
    expected = host.openblas_coretype()
    if expected is None:
        pytest.skip("this CPU has neither AVX-512 nor AVX2 + FMA: OpenBLAS detects alone")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    assert _corename(env).lower() == expected.lower()


def test_an_operators_coretype_wins() -> None:
    assert _corename({**os.environ, "OPENBLAS_CORETYPE": "Sandybridge"}).lower() == "sandybridge"
