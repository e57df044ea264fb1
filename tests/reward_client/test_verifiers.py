"""verifiers' (prime-rl's environments) rewards from a real benchmarker replica.

A rollout's trace is scored the way verifiers scores it after the model answered
(``Task.score(trace)``): the reward hooks run on the real package, the verdicts come from a
real replica over the real broker.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess

import pytest

from hpcrl_common.config import BrokerSettings
from hpcrl_common.rewards import reward_for_status
from tests.benchmarker.conftest import kernel

vf = pytest.importorskip("verifiers.v1")

from hpcrl_reward_client import RewardClient  # noqa: E402
from hpcrl_reward_client.verifiers import (  # noqa: E402
    TASKSET_ID,
    BenchmarkerReward,
    KernelTaskset,
    KernelTasksetConfig,
    close_shared_rewards,
    env_config,
)

CORRECT = f"Here it is:\n```c\n{kernel('naive.c')}```\n"
BROKEN = f"```c\n{kernel('naive.c').replace('double s = 0.0;', 'double s = 0.0')}```"


def rollout(task: vf.Task, reply: str) -> vf.Trace:
    """The trace of a single-turn rollout that answered ``reply``."""
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
    )
    trace.nodes.append(vf.MessageNode(message=vf.UserMessage(content=task.data.prompt_text)))
    trace.nodes.append(
        vf.MessageNode(parent=0, sampled=True, message=vf.AssistantMessage(content=reply))
    )
    return trace


def test_the_taskset_loads_by_id_as_verifiers_loads_environments():
    config = env_config(stages=[2, 6], repeats=2, task={"client": "alice", "scale": 0.1})
    env = vf.load_environment(config)  # what vf-eval and prime-rl do with --env.taskset.id
    assert type(env).__name__ == "SingleAgentEnv" and config.taskset.id == TASKSET_ID
    tasks = list(env.taskset)
    assert [(t.data.task, t.data.stage) for t in tasks] == [("matmul", 2)] * 2 + [("matmul", 6)] * 2
    assert len({t.data.id for t in tasks}) == 4
    assert "matmul_optimized" in tasks[0].data.prompt_text and tasks[0].data.system_prompt
    assert tasks[0].config.client == "alice" and tasks[0].config.scale == 0.1
    assert [fn.__name__ for fn in tasks[0].hooks("reward")] == ["hpcrl_benchmarker"]
    # A task verifiers copies (deferred scoring deep-copies it) keeps the same reward.
    reward = BenchmarkerReward(client=None)  # type: ignore[arg-type]
    task = next(iter(KernelTaskset(reward=reward)))
    assert task.defer_scoring().benchmarker is reward and copy.copy(reward) is reward


@pytest.mark.broker
def test_verdicts_of_a_real_replica_become_verifiers_rewards(
    broker_settings: BrokerSettings, replica: subprocess.Popen
):
    client = RewardClient(broker_settings, "vf-explicit", timeout_s=240)
    explicit = BenchmarkerReward(client, scale=0.5)
    ours = next(iter(KernelTaskset(KernelTasksetConfig(stages=[6]), reward=explicit)))
    # The same taskset built from its config alone, as verifiers' loader builds it.
    configured = next(
        iter(
            vf.load_taskset(
                KernelTasksetConfig(
                    stages=[6],
                    task={
                        "broker": broker_settings.model_dump(),
                        "client": "vf-config",
                        "timeout_s": 240,
                    },
                )
            )
        )
    )

    # A user's own task with the reward as one of its @vf.reward hooks; row fields pick the
    # stage (ikj_omp uses OpenMP, which stage 1 forbids).
    class OwnTask(vf.Task[vf.WireTaskData]):
        fleet = vf.reward(BenchmarkerReward(client, name="fleet"), weight=0.01)

    own = OwnTask(vf.WireTaskData(prompt="Write matmul", stage=1))

    traces = {
        "ok": rollout(ours, CORRECT),
        "broken": rollout(ours, BROKEN),
        "configured": rollout(configured, CORRECT),
        "staged": rollout(own, f"```c\n{kernel('ikj_omp.c')}```"),
    }

    async def score_all() -> None:
        await asyncio.gather(
            ours.score(traces["ok"]),
            ours.score(traces["broken"]),
            configured.score(traces["configured"]),
            own.score(traces["staged"]),
        )

    try:
        asyncio.run(score_all())
    finally:
        client.close()
        close_shared_rewards()
    assert replica.poll() is None
    info = {name: t.info.get("hpcrl_benchmarker") or t.info["fleet"] for name, t in traces.items()}
    assert {name: i["status"] for name, i in info.items()} == {
        "ok": "success",
        "broken": "compile_error",
        "configured": "success",
        "staged": "stage_violation",
    }
    for name in ("ok", "configured"):
        gflops = info[name]["gflops"]
        assert gflops > 0 and info[name]["reward"] == gflops
        assert info[name]["benchmarker"].startswith("benchmarker-")
        assert traces[name].metrics["hpcrl_benchmarker_gflops"] == gflops
    # The reward table's values, scaled where the caller asked.
    assert traces["ok"].rewards["hpcrl_benchmarker"].score == 0.5 * info["ok"]["gflops"]
    assert traces["configured"].reward == info["configured"]["gflops"]
    assert traces["broken"].reward == 0.5 * reward_for_status("compile_error", None) == -20.0
    assert "error" in info["broken"]["error"]
    staged = traces["staged"].rewards["fleet"]
    assert (staged.score, staged.weight) == (-100.0, 0.01) and traces["staged"].reward == -1.0
    assert "openmp" in info["staged"]["techniques"]
    assert not any(t.errors for t in traces.values())


@pytest.mark.broker
def test_no_verdict_by_the_deadline_errs_the_rollout_or_gives_on_missing(
    broker_settings: BrokerSettings,
):
    """No replica: the request waits in the queue past the client's deadline."""
    client = RewardClient(broker_settings, "vf-lonely", timeout_s=1.0)
    try:
        task = next(iter(KernelTaskset(reward=BenchmarkerReward(client))))
        with pytest.raises(vf.TaskError, match="timed out"):
            asyncio.run(task.score(rollout(task, CORRECT)))
        lenient = next(iter(KernelTaskset(reward=BenchmarkerReward(client, on_missing=0.0))))
        trace = rollout(lenient, CORRECT)
        asyncio.run(lenient.score(trace))
    finally:
        client.close()
    assert trace.rewards["hpcrl_benchmarker"].score == 0.0
    assert trace.info["hpcrl_benchmarker"] == {"status": "no_verdict"}
