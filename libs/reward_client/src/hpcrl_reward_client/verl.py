"""verl's ``compute_score`` convention, on a :class:`RewardClient`.

verl's reward managers call ``compute_score(data_source, solution_str, ground_truth,
extra_info, **reward_kwargs)`` per sample (the batch manager: the same names as lists). In
verl's config::

    custom_reward_function:
      path: <site-packages>/hpcrl_reward_client/verl.py
      name: compute_score            # or compute_score_batch with reward_model.reward_manager=batch
      reward_kwargs: {broker_url: "amqp://...", client: "", task: matmul, stage: 6}

``extra_info`` may carry ``task``, ``stage`` and ``opt_level`` per sample. One client per
(broker_url, namespace, client) is kept for the process. The result is a dict whose
``score`` is the verdict's reward (verl logs the other keys).
"""

from __future__ import annotations

import threading
from typing import Any

from hpcrl_common.config import BrokerSettings
from hpcrl_reward_client.client import RewardClient, RewardRequestSpec, RewardTimeout, Verdict

_CLIENTS: dict[tuple[str, str, str], RewardClient] = {}
_LOCK = threading.Lock()


def shared_client(
    broker_url: str, namespace: str = "", client: str = "", **settings: Any
) -> RewardClient:
    key = (broker_url, namespace, client)
    with _LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = RewardClient(
                BrokerSettings(url=broker_url, namespace=namespace, **settings), client
            )
        return _CLIENTS[key]


def _spec(
    solution_str: str, extra_info: Any, task: str, stage: int, opt_level: str
) -> RewardRequestSpec:
    info = extra_info if isinstance(extra_info, dict) else {}
    return RewardRequestSpec(
        solution_str,
        str(info.get("task", task)),
        int(info.get("stage", stage)),
        str(info.get("opt_level", opt_level)),
    )


def _result(verdict: Verdict | None, on_missing: float) -> dict[str, Any]:
    if verdict is None:
        return {"score": on_missing, "status": "no_verdict", "gflops": 0.0}
    return {"score": verdict.reward, "status": verdict.status, "gflops": verdict.gflops or 0.0}


def compute_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any = None,
    extra_info: Any = None,
    *,
    broker_url: str = "amqp://guest:guest@127.0.0.1:5672/%2F",
    namespace: str = "",
    client: str = "",
    task: str = "matmul",
    stage: int = 6,
    opt_level: str = "O3",
    on_missing: float = 0.0,
    reward_client: RewardClient | None = None,
    **_: Any,
) -> dict[str, Any]:
    """One sample's verdict; ``ground_truth`` is unused (the benchmarker verifies)."""
    return compute_score_batch(
        [data_source],
        [solution_str],
        [ground_truth],
        [extra_info],
        broker_url=broker_url,
        namespace=namespace,
        client=client,
        task=task,
        stage=stage,
        opt_level=opt_level,
        on_missing=on_missing,
        reward_client=reward_client,
    )[0]


def compute_score_batch(
    data_sources: list[Any],
    solution_strs: list[str],
    ground_truths: list[Any] | None = None,
    extra_infos: list[Any] | None = None,
    *,
    broker_url: str = "amqp://guest:guest@127.0.0.1:5672/%2F",
    namespace: str = "",
    client: str = "",
    task: str = "matmul",
    stage: int = 6,
    opt_level: str = "O3",
    on_missing: float = 0.0,
    reward_client: RewardClient | None = None,
    **_: Any,
) -> list[dict[str, Any]]:
    """verl's batch reward manager form: every sample sent at once, verdicts in order."""
    rc = reward_client or shared_client(broker_url, namespace, client)
    infos = extra_infos or [None] * len(solution_strs)
    futures = rc.submit_many(
        [_spec(s, i, task, stage, opt_level) for s, i in zip(solution_strs, infos, strict=True)]
    )
    results = []
    for future in futures:
        try:
            results.append(_result(future.result(), on_missing))
        except RewardTimeout:
            results.append(_result(None, on_missing))
    return results
