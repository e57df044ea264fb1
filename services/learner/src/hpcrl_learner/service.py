"""The learner service: rollout batches in, GRPO steps, committed versions and announcements out.

Effectively-once training. A batch's delivery is deferred (not acked) until the step that
used it is committed to the checkpoint store; the batch ids of every committed step are part
of the learner state that is committed with it (see :mod:`hpcrl_learner.state`). After a crash
the broker redelivers the unacked batches: those of a committed step are acked untrained,
the others are trained on once, in the next step.
"""

from __future__ import annotations

import fcntl
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from hpcrl_common.broker import DEFER, Consumer, Delivery, Publish, Reject
from hpcrl_common.checkpoints import CheckpointInfo, CheckpointStore, run_label
from hpcrl_common.messages import RolloutBatch
from hpcrl_common.topology import WEIGHT_UPDATES
from hpcrl_learner import credit, metrics
from hpcrl_learner.backends import BackendFactory, StepResult, backend_for
from hpcrl_learner.batches import BadBatch, PreparedGroup, prepare_group, staleness
from hpcrl_learner.config import LearnerConfig
from hpcrl_learner.state import LearnerState, StateStore
from hpcrl_learner.texts import TextCheck

log = structlog.get_logger("hpcrl.learner")


def step_summary(groups: Sequence[PreparedGroup]) -> dict[str, float]:
    rewards = np.array([r for g in groups for r in g.rewards], dtype=np.float64)
    advantages = np.array([a for g in groups for a in g.advantages], dtype=np.float64)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_max": float(rewards.max()),
        "advantage_std": float(advantages.std()),
        "staleness_mean": float(np.mean([g.staleness for g in groups])),
        "zero_variance_fraction": float(np.mean([g.zero_variance for g in groups])),
    }


class Learner:
    """The handler of `rollout-batches` and the step/commit/announce sequence."""

    def __init__(
        self,
        config: LearnerConfig,
        consumer: Consumer,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        self.settings = config.learner
        self.experiment = config.experiment.name
        self.dropped_since_commit = 0
        self.consumer = consumer
        hold_store(self.settings.checkpoint_dir)
        self.store = CheckpointStore(self.settings.checkpoint_dir)
        self.states = StateStore(self.settings.checkpoint_dir)
        self.store.remove_stale_staging()
        latest = self.store.latest()
        self.version = latest.version if latest else 0
        loaded = self.states.load(self.version) if self.version else None
        if loaded is None and self.version:
            log.warning(
                "no learner state for the latest version; fresh optimizer, and "
                "redelivered batches cannot be recognised",
                version=self.version,
            )
        self.state, state_dir = loaded or (LearnerState(version=self.version), None)
        self.states.tidy(self.version, self.settings.keep_state_versions)
        resume = self.store.path_of(latest) if latest else None
        factory = backend_factory or backend_for(self.settings)
        self.backend = factory(self.settings, resume, state_dir, config.experiment.seed)
        self.trained = set(self.state.trained_ids)
        self.texts = TextCheck(self.settings.model_path, require=self.settings.require_judged_text)
        self.pending: list[tuple[PreparedGroup, Delivery]] = []
        self.failed: str | None = None
        self._lock = threading.Lock()
        metrics.POLICY_VERSION.set(self.version)
        metrics.GROUPS_TRAINED.set(self.state.groups_trained)
        log.info(
            "learner ready",
            version=self.version,
            groups_trained=self.state.groups_trained,
            backend=self.settings.backend,
            store=str(self.store.root),
        )

    # --- consumer side ------------------------------------------------------------------

    def announce_latest(self) -> None:
        """Re-announce the latest version on start: a crash may have come before its
        announcement, and receivers dedupe by the message id ``v<version>``."""
        latest = self.store.latest()
        if latest is not None:
            self.consumer.publish(self._announcement(latest))

    def _announcement(self, info: CheckpointInfo) -> Publish:
        return Publish(
            routing_key="",
            exchange=self.consumer.topology.name(WEIGHT_UPDATES),
            message=info.weight_update(
                self.store.root, run=run_label(self.experiment, self.store.run_id)
            ),
            mandatory=False,  # no generator listening yet is fine: they read the manifest
        )

    def handle(self, batch: RolloutBatch, delivery: Delivery) -> Any:
        with self._lock:
            if self.failed:
                raise RuntimeError(f"learner stopped after a failed step: {self.failed}")
            if batch.id in self.trained:
                metrics.DUPLICATES.inc()
                log.info("batch already trained on; acking", batch=batch.id)
                return []
            if any(group.batch_id == batch.id for group, _ in self.pending):
                return DEFER  # the consumer already tracks this redelivery with the held one
            lag = staleness(batch, self.version)
            metrics.STALENESS.observe(lag)
            if lag > self.settings.max_staleness:
                metrics.STALE_DROPPED.inc()
                self.dropped_since_commit += 1
                log.info(
                    "stale group dropped",
                    batch=batch.id,
                    staleness=lag,
                    max_staleness=self.settings.max_staleness,
                )
                return []
            try:
                group = prepare_group(
                    batch,
                    self.version,
                    adv_eps=self.settings.adv_eps,
                    scale_advantages=self.settings.scale_advantages,
                    negative_advantage_scale=self.settings.negative_advantage_scale,
                    vocab_size=self.backend.vocab_size,
                    max_sequence_tokens=self.settings.max_sequence_tokens,
                    max_abs_reward=self.settings.max_abs_reward,
                    credit=self._credit if self.settings.skip_copied_lines else None,
                )
                self.texts.check(batch)
            except BadBatch as exc:
                # Done, like a stale group: reported as dropped with the next version, or the
                # scheduler would count it outstanding for good and its window would shrink
                # by one group per refusal until nothing is requested.
                metrics.REFUSED.inc()
                self.dropped_since_commit += 1
                raise Reject(str(exc)) from None
            self.pending.append((group, delivery))
            metrics.PENDING_GROUPS.set(len(self.pending))
            if len(self.pending) >= self.settings.groups_per_step:
                self._step()
            elif self.settings.train_on_arrival and not self._skipped(group):
                self._accumulate(group)
            return DEFER

    def _credit(self, prompt: np.ndarray, completions: list[np.ndarray]) -> list[np.ndarray]:
        """``learner.skip_copied_lines``: each completion's credit (credit.py), its tokens'
        text decoded one by one with the policy's tokenizer."""
        tokenizer = self.texts.tokenizer()
        copied = credit.prompt_lines(tokenizer.decode(prompt.tolist(), skip_special_tokens=True))
        return [
            credit.credit_mask(
                [tokenizer.decode([token], skip_special_tokens=True) for token in ids.tolist()],
                copied,
            )
            for ids in completions
        ]

    def health(self) -> tuple[bool, dict[str, Any]]:
        return self.failed is None, {
            "policy_version": self.version,
            "pending_groups": len(self.pending),
            "failed": self.failed,
        }

    # --- the step -----------------------------------------------------------------------

    def _skipped(self, group: PreparedGroup) -> bool:
        """DAPO's option: a group whose rewards are all equal is not trained (no forward or
        backward, not in the step's normaliser); it is acked with the step and counted."""
        return self.settings.skip_zero_variance_groups and group.zero_variance

    def _accumulate(self, group: PreparedGroup) -> None:
        """Trains on a group as it arrives (forward and backward now, the update at the
        step), so that the step's compute overlaps the generation of its other groups."""
        try:
            self.backend.accumulate(group.sequences)
        except Exception:
            # The backend forgot all it accumulated; the step recomputes the groups kept.
            self.pending.pop()
            metrics.PENDING_GROUPS.set(len(self.pending))
            raise

    def _step(self) -> None:
        started = time.perf_counter()
        groups = [group for group, _ in self.pending]
        sequences = [seq for group in groups if not self._skipped(group) for seq in group.sequences]
        try:
            train = self.backend.step(sequences)
        except Exception:
            # The model is unchanged: hand the newest batch back to the consumer (retried,
            # dead-lettered after the delivery limit) and keep the rest waiting.
            self.pending.pop()
            metrics.PENDING_GROUPS.set(len(self.pending))
            raise
        if train.skipped:
            self._hand_back("update skipped: non-finite gradients (the model is unchanged)")
            return
        try:
            info = self._commit(groups, train)
        except Exception as exc:
            # The weights in memory are now ahead of the store: continuing would apply
            # this step twice. Stop; a restart resumes from the last committed version.
            self.failed = repr(exc)
            log.exception("step trained but not committed; stopping the learner")
            self.consumer.stop()
            raise
        self.consumer.publish(self._announcement(info))
        for _, delivery in self.pending:
            self.consumer.settle(delivery)
        self.pending = []
        self.states.tidy(self.version, self.settings.keep_state_versions)
        # The passes run as its groups arrived belong to the step too.
        elapsed = time.perf_counter() - started + train.early_seconds
        self._observe(groups, train, info, elapsed)

    def _hand_back(self, reason: str) -> None:
        """A step that changed nothing consumes nothing: no version, every group retried
        (and dead-lettered with ``reason`` if it keeps failing)."""
        metrics.SKIPPED_STEPS.inc()
        log.error(
            "step not taken; groups handed back",
            reason=reason,
            groups=[group.batch_id for group, _ in self.pending],
        )
        for _, delivery in self.pending:
            self.consumer.fail(delivery, RuntimeError(reason))
        self.pending = []
        metrics.PENDING_GROUPS.set(0)

    def _commit(self, groups: list[PreparedGroup], train: StepResult) -> CheckpointInfo:
        version = self.version + 1
        batch_ids = [group.batch_id for group in groups]
        # Drops since the last commit become durable with this one (a crash before it loses
        # their count, which only narrows the scheduler's window by as many groups).
        state = self.state.advanced(
            version, batch_ids, self.settings.trained_ids_memory, dropped=self.dropped_since_commit
        )
        staging = self.store.staging_dir(version)
        self.backend.save_version(staging)
        self.states.write(state, self.backend.save_optimizer)
        summary = step_summary(groups)
        checkpoint_metrics = {
            "groups_trained": float(state.groups_trained),
            "groups_dropped": float(state.groups_dropped),
            "groups_per_step": float(self.settings.groups_per_step),
            # Not every backend measures every figure; NaN (e.g. no fresh sample, no reference
            # for the KL when beta = 0) is left out below.
            **{
                k: getattr(train, k)
                for k in (
                    "loss",
                    "kl",
                    "clip_fraction",
                    "grad_norm",
                    "learning_rate",
                    "sampler_kl",
                    "tokens",
                    "sampler_kl_fresh",
                    "entropy",
                    "replay_nll",
                    "taught_nll",
                )
            },
            "groups_skipped": float(sum(self._skipped(g) for g in groups)),
            **summary,
        }
        # Weight-update messages carry these and refuse NaN/inf; a skipped step can have them.
        finite = {k: v for k, v in checkpoint_metrics.items() if math.isfinite(v)}
        info = self.store.commit(
            staging,
            version,
            self.version,
            self.backend.format,
            base_model=str(self.settings.model_path.resolve()),
            metrics=finite,
        )
        self.version, self.state = version, state
        self.dropped_since_commit = 0
        self.trained.update(batch_ids)
        if len(self.trained) > self.settings.trained_ids_memory:
            self.trained = set(state.trained_ids)
        return info

    def _observe(
        self, groups: list[PreparedGroup], train: StepResult, info: CheckpointInfo, elapsed: float
    ) -> None:
        metrics.LOSS.set(train.loss)  # NaN is a legitimate gauge value: it shows the trouble
        metrics.KL.set(train.kl)
        metrics.ENTROPY.set(train.entropy)
        metrics.CLIP_FRACTION.set(train.clip_fraction)
        metrics.MASKED_FRACTION.set(train.masked_fraction)
        metrics.SAMPLER_KL.set(train.sampler_kl)
        metrics.SAMPLER_KL_FRESH.set(train.sampler_kl_fresh)
        metrics.GRAD_NORM.set(train.grad_norm)
        metrics.REPLAY_NLL.set(train.replay_nll)
        metrics.TAUGHT_NLL.set(train.taught_nll)
        metrics.LEARNING_RATE.set(train.learning_rate)
        metrics.TOKENS_PER_SECOND.set(train.tokens_per_second)
        summary = step_summary(groups)
        metrics.REWARD_MEAN.set(summary["reward_mean"])
        metrics.REWARD_MAX.set(summary["reward_max"])
        metrics.ADVANTAGE_STD.set(summary["advantage_std"])
        metrics.ZERO_VARIANCE_GROUPS.set(summary["zero_variance_fraction"])
        metrics.POLICY_VERSION.set(self.version)
        metrics.GROUPS_TRAINED.set(self.state.groups_trained)
        metrics.PENDING_GROUPS.set(0)
        metrics.STEPS.inc()
        metrics.STEP_SECONDS.observe(elapsed)
        log.info(
            "step committed",
            version=self.version,
            groups=len(groups),
            seconds=round(elapsed, 3),
            **{k: round(v, 6) for k, v in info.metrics.items()},
        )


class StoreBusy(RuntimeError):
    """Another learner process writes this checkpoint store."""


_HELD_STORES: dict[Path, int] = {}


def hold_store(checkpoint_dir: Path) -> None:
    """Take the store's writer lock for the life of this process, or raise StoreBusy.

    Two learners on one store would both commit "the next version" and each announce weights
    the other never trained. The lock is an flock, released by the kernel when the process
    dies (kill -9 included), so a restarted learner always gets it back.
    """
    root = Path(checkpoint_dir).resolve()
    if root in _HELD_STORES:
        return  # this process already writes it (tests build learners one after another)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".learner.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreBusy(
            f"another learner is writing the checkpoint store {root}: one learner per store"
        ) from None
    _HELD_STORES[root] = fd


def effective_broker(config: LearnerConfig) -> LearnerConfig:
    """Prefetch must cover a whole step, or the step could never fill up."""
    need = config.learner.groups_per_step
    if config.broker.prefetch >= need:
        return config
    log.warning(
        "raising broker.prefetch to groups_per_step",
        prefetch=config.broker.prefetch,
        groups_per_step=need,
    )
    broker = config.broker.model_copy(update={"prefetch": need})
    return config.model_copy(update={"broker": broker})


def build(
    config: LearnerConfig,
    backend_factory: BackendFactory | None = None,
) -> tuple[Consumer, Learner]:
    """The consumer and learner of `hpcrl-learner serve`, wired but not running."""
    from hpcrl_common.topology import ROLLOUT_BATCHES

    config = effective_broker(config)
    consumer = Consumer(config.broker, f"learner-{config.experiment.name}", concurrency=1)
    learner = Learner(config, consumer, backend_factory)
    consumer.subscribe(ROLLOUT_BATCHES, learner.handle)
    learner.announce_latest()
    return consumer, learner
