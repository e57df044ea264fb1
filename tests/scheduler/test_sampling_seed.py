"""The sampling seed of a request depends on (experiment seed, iteration, ordinal) only."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hpcrl_common.messages import GenerateRequest
from hpcrl_scheduler.config import SchedulerConfig, SchedulerSection
from hpcrl_scheduler.scheduler import Scheduler, sampling_seed
from hpcrl_scheduler.store import Store

numbers = st.integers(min_value=0, max_value=2**40)


@given(seed=numbers, iteration=numbers, ordinal=numbers)
def test_the_seed_is_deterministic_and_fits_in_31_bits(seed: int, iteration: int, ordinal: int):
    value = sampling_seed(seed, iteration, ordinal)
    assert value == sampling_seed(seed, iteration, ordinal)
    assert 0 <= value < 2**31


def test_different_numbers_give_different_seeds():
    seeds = {
        (e, t, g): sampling_seed(e, t, g) for e in range(4) for t in range(8) for g in range(64)
    }
    assert len(set(seeds.values())) == len(seeds)
    # Neighbouring numbers must not collide through the separator (1:23 vs 12:3).
    assert sampling_seed(1, 23, 4) != sampling_seed(12, 3, 4)
    assert sampling_seed(0, 1, 23) != sampling_seed(0, 12, 3)


def test_two_experiments_with_the_same_seed_sample_alike(tmp_path):
    """Only the numbers count: the arms of a comparison get the same seed per request."""
    seeds = []
    for name in ("lr0-baseline", "lr5e-7 trained"):
        config = SchedulerConfig(
            experiment={"name": name, "seed": 7},
            scheduler=SchedulerSection(metrics_port=0, max_staleness=0),
        )
        scheduler = Scheduler(config, Store(tmp_path / f"{name}.sqlite"))
        scheduler.step()
        [request] = [m for _, _, m in scheduler.store.unsent()]
        scheduler.store.close()
        assert isinstance(request, GenerateRequest)
        assert request.sampling.seed == sampling_seed(7, 0, 0)
        seeds.append(request.sampling.seed)
    assert seeds[0] == seeds[1]
