"""Use the hpcrl benchmarker fleet as a reward service from your own trainer.

:class:`RewardClient` sends completions to the fleet's ``reward-requests`` queue and gets
each verdict (a ``bench-result/1``: status, reward, GFLOPS, timing, techniques, error) back
in the caller's own queue; :class:`TrlReward` and :func:`compute_score` adapt it to TRL's and
verl's reward-function conventions.
"""

from hpcrl_reward_client.client import (
    RewardClient,
    RewardClientClosed,
    RewardRequestSpec,
    RewardTimeout,
    Verdict,
)
from hpcrl_reward_client.trl import TrlReward
from hpcrl_reward_client.verl import compute_score

__all__ = [
    "RewardClient",
    "RewardClientClosed",
    "RewardRequestSpec",
    "RewardTimeout",
    "TrlReward",
    "Verdict",
    "compute_score",
]
