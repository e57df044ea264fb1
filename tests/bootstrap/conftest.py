"""A small catalogue measured for real by the benchmarker, shared by the bootstrap suites."""

from __future__ import annotations

import pytest

from hpcrl_bootstrap import catalogue
from hpcrl_bootstrap.build import host_isa
from hpcrl_bootstrap.examples import Pairs, pairs_from
from hpcrl_common.task import load_task

SMALL = {1: 4, 2: 4, 3: 3, 4: 2, 5: 2, 6: 2}


@pytest.fixture(scope="session")
def small_plan() -> catalogue.Plan:
    return catalogue.plan(0, host_isa(), SMALL)


@pytest.fixture(scope="session")
def small_measured(small_plan, tmp_path_factory) -> list[catalogue.Measured]:
    measured, _ = catalogue.measure(
        small_plan.all(), load_task("matmul"), "O3", tmp_path_factory.mktemp("catalogue")
    )
    return measured


@pytest.fixture(scope="session")
def small_pairs(small_plan, small_measured) -> Pairs:
    return pairs_from(small_plan, {catalogue.verdict_key(m.kernel): m for m in small_measured})
