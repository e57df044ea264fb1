"""The generator service: generate-requests in, candidates on code-to-bench out (and, for
each group, its commitment on candidate-commitments, before its candidates).

A thin shell around :class:`hpcrl_common.broker.Consumer`. The engine samples one batch of
requests at a time (under the engine lock): the requests waiting when it becomes free go
into one engine call (:mod:`hpcrl_generator.batching`), so their groups decode together and
every candidate of a group comes from one policy version. New versions are loaded between
calls, after validation, without restarting the engine.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from hpcrl_common.broker import Consumer, Delivery, Publish, Reject
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.messages import CandidateCommitment, GenerateRequest, WeightUpdate
from hpcrl_common.metrics import BusyTime
from hpcrl_common.topology import (
    CANDIDATE_COMMITMENTS,
    CODE_TO_BENCH,
    GENERATE_REQUESTS,
    WEIGHT_UPDATES,
    Topology,
)
from hpcrl_generator import metrics
from hpcrl_generator.batching import Sampled, Waiting, WaitingRequests
from hpcrl_generator.candidates import build_candidates
from hpcrl_generator.config import GeneratorSection
from hpcrl_generator.prompt import PromptError, completion_budget, render_prompt
from hpcrl_generator.sampling import GroupJob, Sampler
from hpcrl_generator.weights import (
    CheckpointError,
    ModelSignature,
    Refused,
    Target,
    VersionTracker,
    validate,
)

log = structlog.get_logger("hpcrl.generator")


class VersionNotReady(RuntimeError):
    """The request's policy-version floor was not reached in time (it is retried)."""


class SamplingFailed(RuntimeError):
    """The engine call that held this request failed (the request is retried)."""


def default_replica_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Generator:
    def __init__(
        self,
        sampler: Sampler,
        section: GeneratorSection,
        topology: Topology,
        *,
        replica: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sampler = sampler
        self.section = section
        self.topology = topology
        self.replica = replica or section.replica or default_replica_name()
        self.store = (
            CheckpointStore(section.checkpoint_dir) if section.checkpoint_dir is not None else None
        )
        self.signature = ModelSignature.of(section.model_path)
        self.tracker = VersionTracker(loaded=sampler.version)
        self._engine = threading.Lock()
        self._waiting = WaitingRequests(clock)
        self._clock = clock
        # The consumer's (attach): a request waiting for the engine or a version is not work.
        self.busy = BusyTime()
        metrics.POLICY_VERSION.set(sampler.version)

    # --- weights ----------------------------------------------------------------------

    def catch_up(self) -> None:
        """Load the newest known version if it is newer than the loaded one (engine lock held)."""
        if self.section.poll_manifest:
            self._offer_manifest()
        target = self.tracker.take()
        if target is not None:
            self._load(target)

    def _offer_manifest(self) -> None:
        if self.store is None:
            return
        try:
            info = self.store.latest()
        except (OSError, ValueError) as exc:
            log.warning("cannot read the checkpoint manifest", error=repr(exc))
            return
        if info is not None:
            self.tracker.offer(Target.from_info(info, self.store))

    def _load(self, target: Target) -> None:
        started = self._clock()
        try:
            validate(target, self.signature, verify_checksum=self.section.verify_checksum)
        except CheckpointError as exc:
            self.tracker.refused(target.version)
            metrics.RELOADS.labels("refused").inc()
            log.error("refusing policy version", version=target.version, reason=str(exc))
            return
        validated = self._clock()
        metrics.RELOAD_SECONDS.labels("validate").observe(validated - started)
        try:
            self.sampler.load_weights(target.path, target.version, target.format)
        except Exception as exc:
            self.tracker.refused(target.version)
            metrics.RELOADS.labels("failed").inc()
            log.exception("loading policy version failed", version=target.version, error=repr(exc))
            return
        loaded = self._clock()
        metrics.RELOAD_SECONDS.labels("load").observe(loaded - validated)
        self.tracker.loaded_ok(target.version)
        metrics.POLICY_VERSION.set(target.version)
        metrics.RELOADS.labels("loaded").inc()
        log.info(
            "policy version loaded",
            version=target.version,
            format=target.format,
            validate_s=round(validated - started, 3),
            load_s=round(loaded - validated, 3),
        )

    def start(self) -> None:
        """A replica that starts late begins from the newest valid version in the manifest."""
        if self.store is None:
            return
        with self._engine:
            for info in reversed(self.store.versions()):
                if info.version <= self.tracker.loaded:
                    return
                if self.tracker.offer(Target.from_info(info, self.store)):
                    target = self.tracker.take()
                    if target is not None:
                        self._load(target)
                if self.tracker.loaded == info.version:
                    return

    def on_weight_update(self, update: WeightUpdate, _delivery: Delivery) -> list[Publish]:
        try:
            target = Target.from_update(update, self.store)
        except Refused as exc:
            metrics.ANNOUNCEMENTS_REFUSED.labels(exc.reason).inc()
            log.error("weight announcement refused", version=update.version, reason=str(exc))
            # Dead-lettered, not acked as handled: a forged "v10" sent before the learner
            # committed v10 must not make the genuine announcement a duplicate.
            raise Reject(f"weight-update v{update.version} refused ({exc.reason}): {exc}") from None
        if self.tracker.offer(target):
            log.info("policy version announced", version=update.version, uri=update.uri)
            # Load now if the engine is idle; otherwise the sampling thread loads it
            # before its next request.
            if self._engine.acquire(blocking=False):
                try:
                    self.catch_up()
                finally:
                    self._engine.release()
        return []

    # --- requests ---------------------------------------------------------------------

    def _await_floor(self, floor: int) -> None:
        self.catch_up()
        if self.tracker.loaded >= floor:
            return
        metrics.VERSION_WAITS.inc()
        log.info("waiting for policy version", floor=floor, loaded=self.tracker.loaded)
        started = self._clock()
        deadline = started + self.section.version_wait_s
        try:
            while self.tracker.loaded < floor:
                if self._clock() >= deadline:
                    raise VersionNotReady(
                        f"policy version {floor} not available after "
                        f"{self.section.version_wait_s} s (loaded {self.tracker.loaded})"
                    )
                with self.busy.idle():
                    time.sleep(self.section.version_poll_s)
                self.catch_up()
        finally:
            metrics.VERSION_WAIT_SECONDS.observe(self._clock() - started)

    @contextlib.contextmanager
    def _engine_held(self) -> Iterator[None]:
        # Another request sampling meanwhile is counted busy on its own; this one only waits.
        with self.busy.idle():
            self._engine.acquire()
        try:
            yield
        finally:
            self._engine.release()

    def on_request(self, request: GenerateRequest, _delivery: Delivery) -> list[Publish]:
        waiting = self._waiting.add(request)
        with self._engine_held():
            if not waiting.done():
                self._sample_waiting(waiting)
        try:
            sampled = waiting.result()
        except Reject:
            metrics.REQUESTS.labels("rejected").inc()
            raise
        except VersionNotReady:
            metrics.REQUESTS.labels("version_timeout").inc()
            raise
        except Exception:
            metrics.REQUESTS.labels("failed").inc()
            raise
        return self._publish(request, sampled)

    def _sample_waiting(self, first: Waiting) -> None:
        """Sample ``first`` and the other waiting requests the loaded version may serve,
        in one engine call (engine lock held)."""
        limit = self.section.max_batch_groups
        if limit > 1:
            with self.busy.idle():
                self._waiting.gather(limit, self.section.batch_window_s)
        try:
            self._await_floor(first.floor)
        except VersionNotReady as exc:
            self._waiting.drop(first)
            first.fail(exc)
            return
        batch = self._waiting.take(first, self.tracker.loaded, limit)
        jobs, ready = [], []
        for waiting in batch:
            try:
                jobs.append(self._job(waiting.request))
                ready.append(waiting)
            except Reject as exc:
                waiting.fail(exc)
        started = self._clock()
        try:
            groups = self.sampler.generate_groups(jobs) if jobs else []
        except Exception as exc:
            log.exception("engine call failed", groups=len(jobs), error=repr(exc))
            for waiting in ready:  # each request's own exception: one traceback per thread
                waiting.fail(
                    SamplingFailed(f"the engine call for {len(jobs)} group(s) failed: {exc!r}")
                )
            return
        elapsed = self._clock() - started
        metrics.BATCH_GROUPS.observe(len(jobs))
        for waiting, job, samples in zip(ready, jobs, groups, strict=True):
            waiting.finish(
                Sampled(job.prompt_token_ids, samples, self.sampler.version, elapsed, len(jobs))
            )

    def _job(self, request: GenerateRequest) -> GroupJob:
        prompt_ids = render_prompt(self.sampler.tokenizer, request.prompt)
        try:
            budget = completion_budget(
                len(prompt_ids), request.sampling.max_tokens, self.sampler.max_model_len
            )
        except PromptError as exc:
            raise Reject(str(exc)) from None
        sampling = request.sampling.model_copy(update={"max_tokens": budget})
        return GroupJob(prompt_ids, request.group_size, sampling)

    def _publish(self, request: GenerateRequest, sampled: Sampled) -> list[Publish]:
        backend = self.sampler.backend
        samples = sampled.samples
        candidates = build_candidates(
            request, sampled.prompt_ids, samples, sampled.version, self.replica
        )
        metrics.REQUEST_SECONDS.labels(backend).observe(sampled.seconds)
        metrics.PROMPT_TOKENS.labels(backend).inc(len(sampled.prompt_ids))
        for sample in samples:
            metrics.TOKENS.labels(backend).inc(len(sample.token_ids))
            metrics.COMPLETIONS.labels(backend, sample.finish_reason or "none").inc()
        metrics.REQUESTS.labels("done").inc()
        log.info(
            "group sampled",
            group_id=request.group_id,
            group_size=request.group_size,
            policy_version=sampled.version,
            seconds=round(sampled.seconds, 3),
            groups_in_call=sampled.groups_in_call,
            tokens=sum(len(s.token_ids) for s in samples),
        )
        # The commitment first (one channel keeps the order): what this generator sent for
        # each candidate, which the scheduler holds every result's rollout against.
        commitment = CandidateCommitment.of(candidates, self.replica)
        queue = self.topology.name(CODE_TO_BENCH)
        return [
            Publish(self.topology.name(CANDIDATE_COMMITMENTS), commitment),
            *(Publish(queue, candidate) for candidate in candidates),
        ]

    # --- wiring -----------------------------------------------------------------------

    def attach(self, consumer: Consumer) -> None:
        self.busy = consumer.busy
        consumer.subscribe(GENERATE_REQUESTS, self.on_request)
        consumer.subscribe_fanout(
            WEIGHT_UPDATES, self.replica, self.on_weight_update, durable=False
        )

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {
            "backend": self.sampler.backend,
            "policy_version": self.tracker.loaded,
            "pending_version": self.tracker.pending_version,
        }
