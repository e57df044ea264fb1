"""TRL's GRPOTrainer trains on CPU with its rewards from a real benchmarker replica."""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path

import pytest

from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import STATUSES
from hpcrl_common.rewards import reward_for_status
from hpcrl_reward_client import RewardClient, TrlReward

pytestmark = [pytest.mark.broker, pytest.mark.slow]
trl = pytest.importorskip("trl")


def test_grpo_trains_on_the_benchmarkers_verdicts(
    broker_settings: BrokerSettings, replica: subprocess.Popen, tmp_path: Path
):
    from datasets import Dataset

    from tests.support.models import chat_model

    model = chat_model(tmp_path / "policy")
    prompts = [f"Write a C matmul kernel, variant {i}." for i in range(4)]
    dataset = Dataset.from_dict({"prompt": prompts, "stage": [1, 2, 3, 6]})
    client = RewardClient(broker_settings, "trl-test", timeout_s=240, max_outstanding=3)
    reward = TrlReward(client, task="matmul", scale=0.5)
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=12,
        max_steps=2,
        learning_rate=1e-4,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = trl.GRPOTrainer(
        model=str(model), reward_funcs=[reward], args=config, train_dataset=dataset
    )
    try:
        trainer.train()
    finally:
        client.close()
    assert replica.poll() is None
    assert trainer.state.global_step == 2
    # Every reward it trained on is a verdict of the replica, half the reward table's value.
    assert len(reward.verdicts) >= 2
    logged = [
        entry["rewards/hpcrl_benchmarker/mean"]
        for entry in trainer.state.log_history
        if "rewards/hpcrl_benchmarker/mean" in entry
    ]
    assert len(logged) == len(reward.verdicts)
    for verdicts, mean in zip(reward.verdicts, logged, strict=True):
        assert len(verdicts) == 4 and all(v is not None for v in verdicts)
        for v in verdicts:
            assert v.status in STATUSES and v.benchmarker.startswith("benchmarker-")
            assert v.reward == reward_for_status(v.status, v.gflops)
        assert mean == pytest.approx(statistics.mean(0.5 * v.reward for v in verdicts))
