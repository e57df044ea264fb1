"""A TRL reward function (``GRPOTrainer(reward_funcs=[TrlReward(client)])``).

TRL calls a reward function with keyword arguments ``prompts``, ``completions`` (strings, or
for a conversational dataset lists of ``{"role", "content"}`` messages), ``completion_ids``,
every other dataset column (one value per completion) and ``trainer_state``; it expects one
float per completion, ``None`` where the function has no verdict (TRL makes it NaN and leaves
it out of the mean). Dataset columns ``task``, ``stage`` and ``opt_level``, where present,
override the adapter's defaults per completion. Nothing of TRL is imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hpcrl_reward_client.client import (
    RewardClient,
    RewardRequestSpec,
    RewardTimeout,
    Verdict,
)

Scale = Callable[[Verdict], float] | float | None


def completion_text(completion: Any) -> str:
    """A completion as TRL passes it: a string, or a conversation (the last message's text)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion:
        last = completion[-1]
        if isinstance(last, dict):
            content = last.get("content", "")
            if isinstance(content, list):  # multimodal parts: keep the text ones
                return "".join(part.get("text", "") for part in content if isinstance(part, dict))
            return str(content)
    return str(completion)


def scaled(verdict: Verdict, scale: Scale) -> float:
    """The verdict's reward (the reward table's: log2 GFLOPS, or the status's penalty),
    multiplied by ``scale`` when it is a number, or ``scale(verdict)`` when a function."""
    if scale is None:
        return verdict.reward
    if callable(scale):
        return float(scale(verdict))
    return verdict.reward * float(scale)


class TrlReward:
    """One benchmarker verdict per completion, as a TRL reward function.

    ``on_missing``: the reward of a completion whose verdict did not come by the client's
    deadline; None (the default) lets TRL leave it out rather than charge the completion for
    the fleet's failure. ``verdicts`` keeps every call's verdicts (``keep_verdicts``).
    """

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
        keep_verdicts: bool = True,
    ) -> None:
        self.client = client
        self.task, self.stage, self.opt_level = task, stage, opt_level
        self.scale = scale
        self.on_missing = on_missing
        self.__name__ = name  # TRL names the reward's logged metrics after it
        self.keep_verdicts = keep_verdicts
        self.verdicts: list[list[Verdict | None]] = []

    def specs(self, completions: Sequence[Any], **columns: Any) -> list[RewardRequestSpec]:
        def column(name: str, default: Any) -> list[Any]:
            values = columns.get(name)
            return list(values) if values is not None else [default] * len(completions)

        return [
            RewardRequestSpec(completion_text(c), str(task), int(stage), str(opt))
            for c, task, stage, opt in zip(
                completions,
                column("task", self.task),
                column("stage", self.stage),
                column("opt_level", self.opt_level),
                strict=True,
            )
        ]

    def __call__(
        self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (), **kwargs: Any
    ) -> list[float | None]:
        futures = self.client.submit_many(self.specs(completions, **kwargs))
        verdicts: list[Verdict | None] = []
        for future in futures:
            try:
                verdicts.append(future.result())
            except RewardTimeout:
                verdicts.append(None)
        if self.keep_verdicts:
            self.verdicts.append(verdicts)
        log_metric = kwargs.get("log_metric")
        if callable(log_metric) and verdicts:
            judged = [v for v in verdicts if v is not None]
            log_metric(
                f"{self.__name__}/success_rate",
                sum(v.status == "success" for v in judged) / max(len(judged), 1),
            )
        return [self.on_missing if v is None else scaled(v, self.scale) for v in verdicts]
