"""prime-rl's ``verifiers`` environments (verifiers 0.4: ``import verifiers.v1 as vf``), scored by
the benchmarker fleet through a :class:`RewardClient`.

verifiers 0.4 has no ``Rubric`` class any more: a task scores a rollout with its ``@vf.reward``
methods, each ``async`` and called with what it names of ``task`` (the row's ``TaskData``),
``trace`` (the rollout) and ``runtime``; the rollout's reward is their weighted sum. Here:

* :class:`BenchmarkerReward`: such a reward function. It sends the rollout's last reply
  (``trace.last_reply``) to the fleet and returns the verdict's reward: the reward table's value
  (GFLOPS on success, the status's penalty otherwise), or scaled as the caller
  chooses (``scale``: a number or a function of the verdict, as :class:`~.trl.TrlReward`). The
  task data's ``task``, ``stage`` and ``opt_level``, where it has them, override its defaults.
  The verdict goes to ``trace.info[<name>]``, its GFLOPS to ``trace.metrics[<name>_gflops]``.
  Put it in your own task::

      reward = BenchmarkerReward(client, stage=6)

      class MyTask(vf.Task[MyData]):
          hpcrl_benchmarker = vf.reward(reward)      # or weight=0.01

* :class:`KernelTaskset` (its task :class:`KernelTask`): a whole taskset, hpcrl's own
  seed prompts per (task, stage), scored by the fleet, loadable by id ``hpcrl-kernels``
  (the ``hpcrl_kernels`` module), so ``--env.taskset.id hpcrl-kernels`` in ``vf-eval`` or
  prime-rl; :func:`env_config` is the single-turn environment (the ``null`` chat harness) on
  it. Its tasks build their client from ``--env.taskset.task.broker.*`` (one per settings
  in the process), or use the one handed to ``KernelTaskset(config, reward=...)``.

A rollout whose verdict does not come by the client's deadline raises
:class:`~.client.RewardTimeout`, which verifiers records on the trace as a scoring error
(``TaskError``) rather than charging the completion for the fleet's failure; ``on_missing``
gives it a reward instead.
"""

from __future__ import annotations

import threading
from typing import Any

import verifiers.v1 as vf
from pydantic import Field

from hpcrl_common.config import BrokerSettings
from hpcrl_common.prompts import ISA_NAMES, build_prompt
from hpcrl_common.task import load_task
from hpcrl_reward_client.client import RewardClient, RewardRequestSpec, RewardTimeout, Verdict
from hpcrl_reward_client.trl import Scale, scaled

TASKSET_ID = "hpcrl-kernels"


def _field(data: Any, name: str, default: Any) -> Any:
    value = getattr(data, name, None)
    return default if value is None else value


def verdict_info(verdict: Verdict) -> dict[str, Any]:
    """What a trace keeps of a verdict (``trace.info``): JSON-ready, without the source."""
    return {
        "id": verdict.id,
        "status": verdict.status,
        "reward": verdict.reward,
        "gflops": verdict.gflops,
        "techniques": list(verdict.techniques),
        "error": verdict.error,
        "benchmarker": verdict.benchmarker,
        "timing": verdict.timing.model_dump(mode="json") if verdict.timing else None,
    }


class BenchmarkerReward:
    """An async verifiers reward ``(task, trace) -> float``: the fleet's verdict on the
    rollout's last reply. Shared as is by copies of a task (``copy``/``deepcopy`` return it)."""

    def __init__(
        self,
        client: RewardClient,
        *,
        task: str = "matmul",
        stage: int = 6,
        opt_level: str = "O3",
        scale: Scale = None,
        on_missing: float | None = None,
        name: str = "hpcrl_benchmarker",
    ) -> None:
        self.client = client
        self.task, self.stage, self.opt_level = task, stage, opt_level
        self.scale = scale
        self.on_missing = on_missing
        self.__name__ = name  # the trace's reward key

    def spec(self, task: Any, trace: Any) -> RewardRequestSpec:
        return RewardRequestSpec(
            trace.last_reply,
            str(_field(task, "task", self.task)),
            int(_field(task, "stage", self.stage)),
            str(_field(task, "opt_level", self.opt_level)),
        )

    async def __call__(self, task: Any, trace: Any) -> float:
        try:
            verdict = await self.client.asubmit(self.spec(task, trace))
        except RewardTimeout:
            if self.on_missing is None:
                raise
            trace.info[self.__name__] = {"status": "no_verdict"}
            return float(self.on_missing)
        trace.info[self.__name__] = verdict_info(verdict)
        trace.record_metric(f"{self.__name__}_gflops", verdict.gflops or 0.0)
        return scaled(verdict, self.scale)

    def __copy__(self) -> BenchmarkerReward:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> BenchmarkerReward:
        return self


# --- the taskset ------------------------------------------------------------------------------


class KernelTaskData(vf.TaskData):
    """One prompt: which task, stage and optimisation level its kernel is judged for."""

    task: str = "matmul"
    stage: int = Field(6, ge=1, le=6)
    opt_level: str = "O3"


class KernelTaskConfig(vf.TaskConfig):
    """How the tasks reach the fleet (``--env.taskset.task.*``). Put the broker password in
    ``broker.password_file``, not in ``broker.url``: the env config is logged."""

    broker: BrokerSettings = BrokerSettings()
    client: str = ""
    """The client name (its queue ``reward-verdicts.<client>``); empty = the broker user."""
    timeout_s: float = Field(600.0, gt=0)
    attempt_timeout_s: float | None = None
    retries: int = Field(2, ge=0)
    max_outstanding: int = Field(64, ge=1)
    scale: float | None = None
    """Multiplies the reward table's value (unset: the table's value)."""
    on_missing: float | None = None
    """The reward of a rollout without a verdict by the deadline (unset: the rollout errs)."""


_SHARED: dict[str, BenchmarkerReward] = {}
_SHARED_LOCK = threading.Lock()


def shared_reward(config: KernelTaskConfig) -> BenchmarkerReward:
    """One :class:`BenchmarkerReward` (and client) per distinct task config in the process."""
    key = config.model_dump_json()
    with _SHARED_LOCK:
        if key not in _SHARED:
            client = RewardClient(
                config.broker,
                config.client,
                timeout_s=config.timeout_s,
                attempt_timeout_s=config.attempt_timeout_s,
                retries=config.retries,
                max_outstanding=config.max_outstanding,
                connection_name="hpcrl-reward-client-verifiers",
            )
            _SHARED[key] = BenchmarkerReward(
                client, scale=config.scale, on_missing=config.on_missing
            )
        return _SHARED[key]


def close_shared_rewards() -> None:
    """Close the clients :func:`shared_reward` made (they are daemon threads otherwise)."""
    with _SHARED_LOCK:
        rewards = list(_SHARED.values())
        _SHARED.clear()
    for reward in rewards:
        reward.client.close()


class KernelTask(vf.Task[KernelTaskData, vf.State, KernelTaskConfig]):
    """A kernel prompt whose reward is the fleet's verdict on the reply."""

    def __init__(
        self,
        data: KernelTaskData,
        config: KernelTaskConfig | None = None,
        reward: BenchmarkerReward | None = None,
    ) -> None:
        super().__init__(data, config)
        self.benchmarker = reward

    @vf.reward
    async def hpcrl_benchmarker(self, trace: vf.Trace) -> float:
        reward = self.benchmarker or shared_reward(self.config)
        return await reward(self.data, trace)


class KernelTasksetConfig(vf.TasksetConfig):
    """Which prompts load (``--env.taskset.*``): hpcrl's seed prompt (write the kernel from
    scratch) for every task and stage, ``repeats`` times."""

    id: str = TASKSET_ID
    tasks: list[str] = Field(default_factory=lambda: ["matmul"])
    stages: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    opt_level: str = "O3"
    isa: str = Field("avx512", description=f"the prompts' ISA: {', '.join(ISA_NAMES)}")
    repeats: int = Field(1, ge=1)
    task: KernelTaskConfig = KernelTaskConfig()


class KernelTaskset(vf.Taskset[KernelTask, KernelTasksetConfig]):
    """hpcrl's kernel prompts as a verifiers taskset, scored by the benchmarker fleet."""

    def __init__(
        self, config: KernelTasksetConfig | None = None, reward: BenchmarkerReward | None = None
    ) -> None:
        super().__init__(config if config is not None else KernelTasksetConfig())
        self.reward = reward

    def load(self) -> list[KernelTask]:
        config = self.config
        tasks = []
        for name in config.tasks:
            spec = load_task(name)
            for stage in config.stages:
                system, user = build_prompt(
                    spec,
                    target_stage=stage,
                    mode="seed",
                    parent_source=None,
                    error=None,
                    isa=config.isa,
                )
                for repeat in range(config.repeats):
                    data = KernelTaskData(
                        id=f"{name}-stage{stage}-{repeat}",
                        name=f"{name} stage {stage}",
                        prompt=user.content,
                        system_prompt=system.content,
                        task=name,
                        stage=stage,
                        opt_level=config.opt_level,
                    )
                    tasks.append(KernelTask(data, config.task, reward=self.reward))
        return tasks


def env_config(**taskset: Any) -> vf.EnvConfig:
    """The single-turn environment on :class:`KernelTaskset`: verifiers' ``null`` harness (one
    chat completion, no tools) in a local subprocess. ``taskset``: :class:`KernelTasksetConfig`
    fields (``stages=[6]``, ``task={"broker": {...}, "client": "alice"}``). Load it with
    ``vf.load_environment(env_config(...))``."""
    return vf.resolve_env_config(
        {
            "taskset": {**taskset, "id": TASKSET_ID},
            "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
        }
    )


__all__ = [
    "BenchmarkerReward",
    "KernelTask",
    "KernelTaskConfig",
    "KernelTaskData",
    "KernelTaskset",
    "KernelTasksetConfig",
    "close_shared_rewards",
    "env_config",
    "shared_reward",
    "verdict_info",
]
