"""The SQD scheduler's state machine over the store: plan, admit, join results, close groups.

No broker code here: the service shell (``service.py``) feeds it messages and publishes the
outbox. Every method runs inside one store transaction, so each step is atomic with respect
to a kill -9. No SQL either: a group's life cycle reads as the store's named operations,
``plan_group`` → ``mark_published`` → ``note_progress``… → ``mark_closed``.
"""

from __future__ import annotations

import hashlib
import random
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import structlog

from hpcrl_common.broker import Ignore, Reject
from hpcrl_common.checkpoints import CheckpointInfo, CheckpointStore, split_run
from hpcrl_common.messages import (
    BenchResult,
    BenchSpec,
    CandidateCommitment,
    CandidateCommitmentV1,
    ChatMessage,
    CommitmentEntry,
    GenerateRequest,
    SamplingParams,
    WeightUpdate,
    candidate_id,
    rollout_sha256,
)
from hpcrl_common.prompts import Templates, build_prompt, failure_text, load_templates
from hpcrl_common.restyle import restyle_for_task
from hpcrl_common.stages import FIRST_STAGE
from hpcrl_common.task import TaskError, TaskSpec, load_task, seed_program
from hpcrl_common.topology import BENCH_RESULTS, CODE_TO_BENCH, GENERATE_REQUESTS, ROLLOUT_BATCHES
from hpcrl_scheduler import commitments, confirm, metrics
from hpcrl_scheduler.anchors import AnchorError, is_anchor, load_anchor_corpus, select_anchors
from hpcrl_scheduler.config import SchedulerConfig
from hpcrl_scheduler.groups import Parent, close_group, majority_class
from hpcrl_scheduler.pacing import PacingState, hold_reason, outstanding
from hpcrl_scheduler.peaks import PeakBook
from hpcrl_scheduler.selection import SEED_ID, Node, Program, Ratios, dedupe, select_tasks
from hpcrl_scheduler.store import BatchOutcome, CloseReason, GroupRow, Store

log = structlog.get_logger("hpcrl.scheduler")


class SchedulerError(RuntimeError):
    pass


def task_seed(task: TaskSpec) -> str:
    source = seed_program(task)
    if source is None:
        raise SchedulerError(
            f"no seed program for task {task.name!r} (the task names none and none is built "
            "in); set scheduler.seed_program"
        )
    return source


def load_tasks(names: list[str]) -> dict[str, TaskSpec]:
    """Each task of the experiment by the name or path it is given as, loaded; a clear error
    naming the task that does not load, or two that are the same task."""
    tasks: dict[str, TaskSpec] = {}
    for name in names:
        try:
            tasks[name] = load_task(name)
        except (TaskError, OSError, ValueError) as exc:
            raise SchedulerError(f"experiment task {name!r} does not load: {exc}") from exc
    by_name: dict[str, str] = {}
    for name, task in tasks.items():
        if task.name in by_name:
            raise SchedulerError(
                f"experiment tasks {by_name[task.name]!r} and {name!r} are the same task "
                f"{task.name!r}: name each task once"
            )
        by_name[task.name] = name
    return tasks


def seed_id_of(task: TaskSpec, several: bool) -> str:
    """The seed program's id: ``seed`` in a run of one task (as before several could share a
    run), ``seed.<task name>`` in a run of several."""
    return f"{SEED_ID}.{task.name}" if several else SEED_ID


def group_id_of(experiment: str, seed: int, iteration: int, ordinal: int) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", experiment)[:100] or "x"
    return f"{slug}.s{seed}.t{iteration}.g{ordinal:04d}"


def sampling_seed(experiment_seed: int, iteration: int, ordinal: int) -> int:
    """The sampling seed of one request. Derived from numbers, not from the experiment's name,
    so two arms of a comparison (say learning rate 0 and the trained one) draw the same
    randomness for the same request until their weights differ."""
    digest = hashlib.sha256(f"{experiment_seed}:{iteration}:{ordinal}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


def parent_of(program: Program | None) -> Parent | None:
    """What parent_relative rewards need of a group's parent (None: not in the store)."""
    if program is None:
        return None
    gflops = program.gflops if program.status == "success" else None
    return Parent(gflops=gflops, key=program.key, host_class=program.host_class)


def repair_error(parent: Program) -> str:
    return failure_text(parent.status, parent.error)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, store: Store, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config
        self.section = config.scheduler
        self.store = store
        self.clock = clock
        # The run's tasks, by the name or path the config gives (what groups, programs and
        # requests carry), in a fixed order: by that name.
        self.weights: dict[str, float] = dict(sorted(config.experiment.task_weights().items()))
        self.tasks: dict[str, TaskSpec] = load_tasks(list(self.weights))
        self.several = len(self.tasks) > 1
        if self.several and self.section.seed_program is not None:
            raise SchedulerError(
                "scheduler.seed_program names one seed file, but the experiment has several "
                f"tasks ({', '.join(self.tasks)}): each task's seed comes from its own files"
            )
        # The task of a run of one (kept for callers that know only one).
        self.task: TaskSpec = next(iter(self.tasks.values()))
        self.anchors = self._load_anchors()
        templates_path = self.section.prompt_templates
        self.templates: Templates = load_templates(str(templates_path) if templates_path else None)
        self.ratios = Ratios(
            self.section.ratio_deepen, self.section.ratio_improve, self.section.ratio_repair
        )
        # Since when pacing holds every pending request, and why (in memory: a restart
        # starts the deadline again).
        self.held_since: float | None = None
        self.held_reason: str | None = None
        self.peaks = PeakBook(
            self.section.host_peaks,
            max_clock_ghz=self.section.max_clock_ghz,
            max_cores=self.section.max_host_cores,
        )
        self._init_store()

    # --- set-up ---------------------------------------------------------------------

    def _init_store(self) -> None:
        exp = self.config.experiment
        # One task: its name or path, as before several could share a run; several: the
        # list of them (a run's tasks are fixed; their weights may change on a restart).
        task_identity: str | list[str] = list(self.tasks) if self.several else exp.task
        identity = {"experiment": exp.name, "seed": exp.seed, "task": task_identity}
        with self.store.tx() as s:
            stored = {key: s.get(key) for key in identity}
            if stored["experiment"] is None:
                for key, value in identity.items():
                    s.set(key, value)
                s.set("iteration", -1)
                s.set("created_at", self.clock())
                for name, task in self.tasks.items():
                    s.add_program(self._seed_of(name, task), None)
            elif stored != identity:
                raise SchedulerError(
                    f"{s.path} belongs to {stored}, not {identity}: use another "
                    "scheduler.db_path (or experiment.name) for a different experiment"
                )
            s.set("iterations", self.section.iterations)
            s.set("reward_mode", self.section.reward_mode)
            # Stored so that a group's parent is found like any other (kept if a restart
            # changes the corpus: groups already planned still name them).
            for anchor in self.anchors:
                s.add_program(anchor, None)
            # Time spent down does not count against a group's deadline, nor against a held
            # result's wait for its commitment.
            s.restart_deadlines(self.clock())
            s.restart_holds(self.clock())

    def _load_anchors(self) -> list[Program]:
        if self.section.anchor_nodes <= 0:
            return []
        if self.several:
            raise SchedulerError(
                "scheduler.anchor_nodes works on a run of one task; this experiment has "
                f"several ({', '.join(self.tasks)})"
            )
        if self.section.anchor_corpus is None:
            raise SchedulerError(
                "scheduler.anchor_nodes is set but scheduler.anchor_corpus is not: name the "
                "policy's corpus.json (hpcrl-bootstrap writes it beside the model)"
            )
        name, task = next(iter(self.tasks.items()))
        try:
            return load_anchor_corpus(self.section.anchor_corpus, name, corpus_task=task.name)
        except AnchorError as exc:
            raise SchedulerError(str(exc)) from exc

    def _seed_of(self, name: str, task: TaskSpec) -> Program:
        path = self.section.seed_program
        return Program(
            id=seed_id_of(task, self.several),
            stage=FIRST_STAGE,
            status="success",
            source=Path(path).read_text() if path else task_seed(task),
            mode="seed",
            iteration=-1,
            task=name,
        )

    def bench_of(self, group: GroupRow) -> BenchSpec:
        """What the benchmarker is asked to judge a group's completions as: its own task."""
        exp = self.config.experiment
        return BenchSpec(task=group.task, stage=group.target_stage, opt_level=exp.opt_level)

    # --- the loop step --------------------------------------------------------------

    def step(self) -> None:
        """Close overdue groups, start the next iteration if due, admit requests."""
        now = self.clock()
        with self.store.tx():
            self._expire_held(now)
            self._close_overdue(now)
            self._advance()
            self._admit(now)

    def iteration(self) -> int:
        return int(self.store.get("iteration", -1))

    def done(self) -> bool:
        t = self.iteration()
        if t < self.section.iterations - 1:
            return False
        return self.store.count_open_groups(t) == 0

    def iterations_done(self) -> int:
        """Iterations up to the current one with every group closed."""
        return sum(
            1 for i in range(max(self.iteration(), -1) + 1) if self.store.count_open_groups(i) == 0
        )

    def _advance(self) -> None:
        t = self.iteration()
        if t >= 0 and self.store.count_open_groups(t):
            return
        if t + 1 >= self.section.iterations:
            return
        self._plan(t + 1)

    def _plan(self, t: int) -> None:
        store, exp = self.store, self.config.experiment
        pool = store.pool(t - 1) if t > 0 else []
        pools: dict[str, list[Program]] = {}
        for program in pool:
            pools.setdefault(program.task, []).append(program)
        anchors = select_anchors(
            self.anchors, self.section.anchor_nodes, iteration=t, seed=exp.seed
        )
        budget = self.section.node_budget
        nodes = select_tasks(
            pools,
            store.seed_programs(),
            self.weights,
            iteration=t,
            # Anchors come out of the budget, so a run costs what it cost without them.
            budget=max(budget - len(anchors), 1) if budget > 0 else 0,
            ratios=self.ratios,
            seed=exp.seed,
        )
        # Last, so that the pool's nodes keep their ordinals and sampling seeds.
        nodes += anchors
        for ordinal, node in enumerate(nodes):
            prompt = build_prompt(
                self.tasks[node.task],
                target_stage=node.target_stage,
                mode=node.mode,  # type: ignore[arg-type]
                parent_source=self._shown_parent(node, t, ordinal),
                error=repair_error(node.parent) if node.mode == "repair" else None,
                isa=self.section.isa,
                templates=self.templates,
            )
            store.plan_group(
                group_id_of(exp.name, exp.seed, t, ordinal),
                iteration=t,
                ordinal=ordinal,
                parent_id=node.parent.id,
                mode=node.mode,
                target_stage=node.target_stage,
                group_size=self.section.group_size,
                prompt=[message.model_dump() for message in prompt],
                task=node.task,
            )
        store.set("iteration", t)
        modes = {
            mode: sum(n.mode == mode for n in nodes)
            for mode in ("seed", "deepen", "improve", "repair")
        }
        extra = {}
        if self.several:
            extra["tasks"] = {task: sum(n.task == task for n in nodes) for task in self.tasks}
        log.info(
            "iteration planned",
            iteration=t,
            nodes=len(nodes),
            pool=len(pool),
            anchors=len(anchors),
            **modes,
            **extra,
        )

    def _shown_parent(self, node: Node, iteration: int, ordinal: int) -> str:
        """The parent's text as its prompt shows it: restyled in a share of seed, deepen and
        improve prompts, never in repair ones (their error names the parent's own lines). The
        draw depends on the seed and the node's place only, so two arms of one experiment
        restyle alike."""
        source = node.parent.source
        share = self.section.restyle_parents
        if share <= 0 or node.mode == "repair":
            return source
        rng = random.Random(f"hpcrl-restyle/{self.config.experiment.seed}/{iteration}/{ordinal}")
        if rng.random() >= share:
            return source
        return restyle_for_task(source, self.tasks[node.task], rng)

    def pacing_state(self) -> PacingState:
        s = self.store
        return PacingState(
            batches_published=s.count_batches_sent(),
            groups_in_flight=s.count_groups_in_flight(),
            groups_trained=int(s.get("groups_trained", 0)),
            groups_per_step=int(s.get("groups_per_step", self.section.initial_groups_per_step)),
        )

    def _admit(self, now: float) -> None:
        pending = self.store.pending_groups()
        held: dict[str, int] = {"in_flight": 0, "staleness": 0}
        for index, group in enumerate(pending):
            reason = hold_reason(
                self.pacing_state(),
                max_staleness=self.section.max_staleness,
                max_groups_in_flight=self.section.max_groups_in_flight,
            )
            if reason is not None:
                held[reason] = len(pending) - index
                break
            self._publish_request(group, now)
        for reason, count in held.items():
            metrics.HELD.labels(reason).set(count)
        self._note_hold(pending, held, now)

    def _note_hold(self, pending: list[GroupRow], held: dict[str, int], now: float) -> None:
        """Remember since when pacing holds every pending request with no group in flight:
        nothing moves until the learner reports (a group in flight has its own deadline)."""
        reason = next((r for r, count in held.items() if pending and count == len(pending)), None)
        if reason is None or self.store.count_groups_in_flight():
            self.held_since, self.held_reason = None, None
        elif self.held_since is None or self.held_reason != reason:
            self.held_since, self.held_reason = now, reason

    def pacing_stuck(self) -> dict | None:
        """Why pacing has held every request longer than ``pacing_hold_deadline_s``, or
        None: the health detail of a scheduler that makes no progress."""
        if self.held_since is None:
            return None
        held_for = self.clock() - self.held_since
        if held_for < self.section.pacing_hold_deadline_s:
            return None
        state = self.pacing_state()
        return {
            "reason": self.held_reason,
            "held_for_s": round(held_for, 1),
            "deadline_s": self.section.pacing_hold_deadline_s,
            "outstanding": outstanding(state),
            "groups_trained": state.groups_trained,
            "groups_per_step": state.groups_per_step,
            "groups_in_flight": state.groups_in_flight,
            "policy_version": int(self.store.get("policy_version", 0)),
        }

    def _publish_request(self, group: GroupRow, now: float) -> None:
        exp, section = self.config.experiment, self.section
        floor = int(self.store.get("policy_version", 0)) if section.version_floor else 0
        seed = sampling_seed(exp.seed, group.iteration, group.ordinal)
        request = GenerateRequest(
            id=group.id,
            experiment=exp.name,
            iteration=group.iteration,
            parent_id=group.parent_id,
            mode=group.mode,  # type: ignore[arg-type]
            prompt=[ChatMessage(**message) for message in group.prompt],  # type: ignore[arg-type]
            group_size=group.group_size,
            sampling=SamplingParams(
                temperature=section.temperature,
                top_p=section.top_p,
                max_tokens=section.max_tokens,
                seed=seed,
            ),
            min_policy_version=floor,
            bench=self.bench_of(group),
            created_at=now,
        )
        self.store.enqueue(GENERATE_REQUESTS, request)
        self.store.mark_published(group.id, min_policy_version=floor, at=now)
        metrics.REQUESTS.labels(group.mode).inc()

    def _close_overdue(self, now: float) -> None:
        for group in self.store.overdue_groups(now - self.section.group_deadline_s):
            log.warning(
                "group deadline passed; closing it short",
                group=group.id,
                results=self.store.count_results(group.id),
                expected=group.group_size,
            )
            self._close(group, now, "deadline", overdue=True)

    # --- messages -------------------------------------------------------------------

    def handle_result(self, result: BenchResult, publisher: str | None = None) -> None:
        """File one result; ``publisher``: its broker user (``user_id``, broker-checked).

        Refused: :class:`Reject` (dead-lettered). Held for its candidate's commitment
        (:mod:`hpcrl_scheduler.commitments`): stored, then :class:`Ignore`, so that its id is
        not remembered as handled and another result under it is still taken."""
        now = self.clock()
        held = False
        with self.store.tx() as s:
            if s.has_result(result.id):
                metrics.RESULTS_IGNORED.labels("duplicate").inc()
                return
            group = s.group(result.group_id)
            if group is None:
                owner = s.get(confirm.INDEX_PREFIX + result.group_id)
                if owner is not None:
                    self._handle_confirmation(str(owner), result, now, publisher)
                    return
                raise Reject(f"result {result.id} belongs to no group of this scheduler")
            if result.index >= group.group_size:
                raise Reject(f"result index {result.index} >= group size {group.group_size}")
            if result.bench.task != group.task:
                # Judged as another task than its group's: its GFLOPS are not of this pool.
                metrics.RESULTS_IGNORED.labels("wrong_task").inc()
                raise Reject(
                    f"result {result.id} was judged as task {result.bench.task!r}, but its "
                    f"group {group.id} is of task {group.task!r}"
                )
            refused = self.peaks.admit(s, result)
            if refused is not None:
                metrics.RESULTS_IGNORED.labels("above_peak").inc()
                log.warning(
                    "result above its host class's peak refused",
                    result=result.id,
                    host=result.host.hostname,
                    benchmarker=result.benchmarker,
                    reason=refused,
                )
                raise Reject(refused)
            if group.state != "closed" and result.rollout is not None:
                verdict, why = commitments.check(result, s.commitments_of(result.id))
                if verdict == "mismatch":
                    raise Reject(self._refuse_rollout(result, publisher, why))
                if verdict == "unknown" and self.section.require_commitments:
                    held = True
                    self._hold(group, result, publisher, now)
            if not held:
                self._file(group, result, publisher, now)
        if held:
            raise Ignore(f"result {result.id} held until its candidate's commitment comes")

    def _file(
        self, group: GroupRow, result: BenchResult, publisher: str | None, now: float
    ) -> None:
        """File an admitted result (late once its group is closed); close a complete group."""
        s = self.store
        self._note_publisher(result, publisher)
        late = group.state == "closed"
        s.add_result(result, received_at=now, late=late)
        if late:
            metrics.RESULTS_IGNORED.labels("late").inc()
            return
        s.note_progress(group.id, now)
        metrics.RESULTS.labels(result.status).inc()
        metrics.RESULT_LAG.observe(max(0.0, now - result.created_at))
        if s.count_results(group.id) >= group.group_size:
            self._close(group, now, "complete")

    # --- commitments (see commitments.py) ---------------------------------------------

    def _hold(
        self, group: GroupRow, result: BenchResult, publisher: str | None, now: float
    ) -> None:
        assert result.rollout is not None
        fresh = self.store.hold_result(
            result,
            rollout_sha256=rollout_sha256(result.rollout),
            publisher=publisher,
            at=now,
        )
        if not fresh:
            metrics.RESULTS_IGNORED.labels("duplicate").inc()
            return
        self.store.note_progress(group.id, now)
        metrics.HELD_RESULTS.inc()
        log.info(
            "result held for its candidate's commitment",
            result=result.id,
            benchmarker=result.benchmarker,
        )

    def _refuse_rollout(
        self, result: BenchResult, publisher: str | None, why: str, reason: str = "rollout_mismatch"
    ) -> str:
        """Count and log a result refused for its rollout; the dead letter's reason."""
        metrics.RESULTS_IGNORED.labels(reason).inc()
        log.warning(
            "result refused: its rollout is not the generator's",
            result=result.id,
            reason=reason,
            detail=why,
            host=result.host.hostname,
            benchmarker=result.benchmarker,
            publisher=publisher,
        )
        return f"result {result.id} refused ({reason}): {why}"

    def handle_commitment(self, commitment: CandidateCommitment | CandidateCommitmentV1) -> None:
        """File the generator's commitment to a group's candidates (with their texts; a
        ``candidate-commitment/1`` of an older generator has hashes only); decide the results
        held for it. Refused (:class:`Reject`): of no group of this scheduler, or of an
        index outside the group."""
        now = self.clock()
        with self.store.tx() as s:
            group = s.group(commitment.group_id)
            if group is None:
                metrics.COMMITMENTS.labels("refused").inc()
                raise Reject(f"commitment {commitment.id}: no group {commitment.group_id!r} here")
            beyond = [e.index for e in commitment.entries if e.index >= group.group_size]
            if beyond:
                metrics.COMMITMENTS.labels("refused").inc()
                raise Reject(
                    f"commitment {commitment.id}: indices {beyond} >= group size {group.group_size}"
                )
            if group.state == "closed":
                metrics.COMMITMENTS.labels("late").inc()
                return  # its results were decided; later ones are late anyway
            fresh = 0
            texts = isinstance(commitment, CandidateCommitment)
            for entry in commitment.entries:
                fresh += s.add_commitment(
                    candidate_id(group.id, entry.index),
                    group_id=group.id,
                    rollout_sha256=entry.rollout_sha256,
                    completion_sha256=entry.completion_sha256,
                    completion=entry.completion if isinstance(entry, CommitmentEntry) else None,
                    at=now,
                )
            outcome = ("filed" if texts else "filed_without_text") if fresh else "duplicate"
            metrics.COMMITMENTS.labels(outcome).inc()
            if fresh and not texts:
                log.warning(
                    "a candidate-commitment/1 (no texts) filed: its group's winner cannot be "
                    "measured again from the committed text (scheduler.require_committed_text)",
                    commitment=commitment.id,
                    generator=commitment.generator,
                )
            for entry in commitment.entries:
                self._decide_held(candidate_id(group.id, entry.index), now)

    def _decide_held(self, result_id: str, now: float, *, expired: bool = False) -> None:
        """Decide the results held under ``result_id``: file the first that matches its
        commitment, refuse those that do not; ``expired``: none came in time."""
        s = self.store
        for held in s.held_results_of(result_id):
            result = held.result
            group = s.group(result.group_id)
            if group is None or group.state == "closed" or s.has_result(result.id):
                # Its group closed (which released it), or another result took its place.
                if s.release_held(held.seq):
                    metrics.RESULTS_IGNORED.labels("duplicate" if group else "late").inc()
                continue
            verdict, why = commitments.check(result, s.commitments_of(result.id))
            if verdict == "unknown" and not expired:
                continue
            s.release_held(held.seq)
            unchecked = verdict == "unknown" and not self.section.require_commitments
            if verdict == "match" or unchecked:
                self._file(group, result, held.publisher, now)
                continue
            if verdict == "unknown":
                reason = "no_commitment"
                why = (
                    f"no commitment of the generator for {result.id} came within "
                    f"commitment_wait_s {self.section.commitment_wait_s:g} s"
                )
            else:
                reason = "rollout_mismatch"
            s.enqueue_dead_letter(
                BENCH_RESULTS, result, self._refuse_rollout(result, held.publisher, why, reason)
            )

    def _expire_held(self, now: float) -> None:
        """Results held longer than ``commitment_wait_s``: decided without a commitment."""
        cutoff = now - self.section.commitment_wait_s
        for result_id in dict.fromkeys(h.result.id for h in self.store.held_since_before(cutoff)):
            self._decide_held(result_id, now, expired=True)

    def handle_weight_update(self, update: WeightUpdate) -> None:
        """Take a policy version (the floor) and the learner's pacing figures from an
        announcement that the checkpoint store backs. Not ours: :class:`Ignore`; refused:
        :class:`Reject` (dead-lettered with the reason). Neither marks the id as handled,
        so the genuine announcement of a version refused too early is still taken."""
        experiment, learner_run = split_run(update.run)
        if experiment != self.config.experiment.name:
            # Another experiment's versions must never set the floor: generators would wait
            # for a version that this run never makes.
            metrics.UPDATES_IGNORED.labels("other_experiment").inc()
            raise Ignore(f"weight update of another experiment ({update.run!r})")
        with self.store.tx() as s:
            pinned = s.get("learner_run", None)
            if pinned is not None and learner_run != pinned:
                self._refuse(
                    update,
                    "other_run",
                    f"run {learner_run!r} is not the learner run {pinned!r} this scheduler follows",
                )
            floor = int(s.get("policy_version", 0))
            if update.version <= floor:
                metrics.UPDATES_IGNORED.labels("old").inc()
                return  # an older or repeated announcement changes nothing
            info = self._stored_version(update, learner_run)
            if update.version > floor + self.section.max_version_jump:
                self._refuse(
                    update,
                    "too_far",
                    f"version {update.version} is more than "
                    f"max_version_jump {self.section.max_version_jump} above the "
                    f"floor {floor}",
                )
            pacing = self._pacing_of(update, info)
            s.set("learner_run", learner_run)
            s.set("policy_version", update.version)
            if pacing is not None:
                done, per_step = pacing
                s.set("groups_trained", done)
                s.set("groups_per_step", per_step)
        log.info("policy version seen", version=update.version, pacing=pacing)

    def _refuse(self, update: WeightUpdate, reason: str, why: str) -> NoReturn:
        metrics.UPDATES_IGNORED.labels(reason).inc()
        log.warning(
            "weight update refused",
            version=update.version,
            run=update.run,
            reason=reason,
            detail=why,
        )
        raise Reject(f"weight-update v{update.version} refused ({reason}): {why}")

    def _stored_version(self, update: WeightUpdate, learner_run: str) -> CheckpointInfo:
        """The checkpoint store's entry of the announced version, or a refusal."""
        root = self.section.checkpoint_dir
        if root is None:
            self._refuse(
                update,
                "no_store",
                "scheduler.checkpoint_dir is not set: "
                "announcements cannot be checked, so none is taken",
            )
        store = CheckpointStore(root)
        try:
            run_id = store.run_id
            info = store.get(update.version)
        except KeyError:
            self._refuse(
                update, "not_in_store", f"version {update.version} is not in the manifest of {root}"
            )
        except (OSError, ValueError, TypeError) as exc:
            # An unreadable manifest: a passing fault (retried), not the message's.
            raise RuntimeError(f"cannot read the checkpoint manifest of {root}: {exc!r}") from exc
        if run_id != learner_run:
            self._refuse(
                update, "mismatch", f"run {learner_run!r} is not the store's run {run_id!r}"
            )
        if (info.checksum, info.format, info.parent_version) != (
            update.checksum,
            update.format,
            update.parent_version,
        ):
            self._refuse(
                update,
                "mismatch",
                f"the announcement's {update.format} "
                f"{update.checksum} (parent {update.parent_version}) is not the "
                f"manifest's {info.format} {info.checksum} "
                f"(parent {info.parent_version})",
            )
        return info

    def _pacing_of(self, update: WeightUpdate, info: CheckpointInfo) -> tuple[int, int] | None:
        """(groups done, groups per step) to pace by, or None when not reported; a refusal
        unless they are the manifest's, monotone and within what this scheduler sent."""
        if update.groups_trained is None:
            return None
        stored = info.pacing()
        announced = {
            "groups_trained": update.groups_trained,
            "groups_dropped": update.groups_dropped,
            "groups_per_step": update.groups_per_step,
        }
        differ = {k: (v, stored[k]) for k, v in announced.items() if k in stored and stored[k] != v}
        if differ:
            self._refuse(
                update,
                "pacing",
                f"pacing figures differ from the manifest's (announced, stored): {differ}",
            )
        # Groups the learner dropped as stale are done too: they never come back.
        done = update.groups_trained + update.groups_dropped
        before = int(self.store.get("groups_trained", 0))
        sent = self.store.count_batches_sent()
        if done < before:
            self._refuse(
                update,
                "pacing",
                f"{done} groups done is fewer than the {before} "
                f"of an earlier version (they only grow within a run)",
            )
        if done > sent:
            # More than were sent: batches not of this scheduler (forged with its credential,
            # or dead letters replayed) were counted. The version is the store's, so it is
            # taken; refusing it would hold every request for good. Pacing counts at most
            # what was sent, so no request runs further ahead than it should.
            metrics.PACING_CLAMPED.inc()
            log.warning(
                "learner reports more groups done than were sent; counting the sent",
                version=update.version,
                done=done,
                sent=sent,
            )
            done = sent
        per_step = update.groups_per_step or int(
            self.store.get("groups_per_step", self.section.initial_groups_per_step)
        )
        return done, per_step

    # --- winners confirmed (see confirm.py) -------------------------------------------

    def _confirming(
        self,
        group: GroupRow,
        results: list[BenchResult],
        now: float,
        reason: CloseReason,
        overdue: bool,
    ) -> bool:
        """True while the group waits for its winner's second measurement (or one was just
        requested); False once it may close with ``results`` less those dropped."""
        s, key = self.store, confirm.STATE_PREFIX + group.id
        state = confirm.ConfirmState.of(s.get(key))
        if state.ceiling is not None:
            return self._confirming_runner_up(group, results, state, now, reason, overdue)
        results = state.apply(results)
        ranked = [r for r in results if r.status == "success" and r.gflops is not None]
        if ranked:
            majority = majority_class(results)
            ranked = [r for r in ranked if r.host.host_class == majority]
        if not ranked:
            return False
        winner = max(ranked, key=lambda r: (r.gflops or 0.0, -r.index))
        if winner.id in state.confirmed:
            return False
        if state.waiting == winner.id and not overdue:
            return True  # asked already; its answer is on the way
        if state.waiting == winner.id or state.round >= self.section.confirm_rounds:
            outcome = "timed_out" if state.waiting == winner.id else "unconfirmed"
            metrics.CONFIRMATIONS.labels(outcome).inc()
            log.warning(
                "group winner dropped unconfirmed",
                group=group.id,
                result=winner.id,
                gflops=winner.gflops,
                why=outcome,
                rounds=state.round,
            )
            state.dropped.append(winner.id)
            state.waiting = None
            s.set(key, state.to_json())
            return False
        if winner.source is None:
            # Nothing to measure again. Counted only where no result has its source
            # (benchmarker.include_source = false); else a benchmarker credential could set
            # the group's maximum by leaving the source out.
            metrics.CONFIRMATIONS.labels("no_source").inc()
            if self.section.confirm_without_source == "count":
                return False
            log.warning(
                "group winner without its source dropped",
                group=group.id,
                result=winner.id,
                gflops=winner.gflops,
                benchmarker=winner.benchmarker,
            )
            state.dropped.append(winner.id)
            s.set(key, state.to_json())
            return self._confirming(group, results, now, reason, overdue)
        text = self._committed_text(winner)
        if text is None and self.section.require_committed_text:
            # Measured again from the source it reports, a fast kernel from elsewhere
            # reported against a slow candidate would be confirmed (and that candidate's
            # tokens trained at the top reward): only the generator's text is measured.
            metrics.CONFIRMATIONS.labels("no_text").inc()
            log.warning(
                "group winner without a committed text dropped",
                group=group.id,
                result=winner.id,
                gflops=winner.gflops,
                benchmarker=winner.benchmarker,
            )
            state.dropped.append(winner.id)
            s.set(key, state.to_json())
            return self._confirming(group, results, now, reason, overdue)
        if text is None:
            metrics.CONFIRMATIONS.labels("reported_source").inc()
        self._request_confirmation(group, state, winner, text, now, reason)
        return True

    def _confirming_runner_up(
        self,
        group: GroupRow,
        results: list[BenchResult],
        state: confirm.ConfirmState,
        now: float,
        reason: CloseReason,
        overdue: bool,
    ) -> bool:
        """A winner is confirmed, at the lower of its two measurements. A success of the
        group measured once above that ceiling would count at the ceiling too (state.apply),
        tied with the winner although the group's own timings ranked them: in a run on a
        busy node that erased the winner's lead in 35-52 % of groups. While rounds are left,
        the fastest such success is measured again as the winner was, so that the group's
        top ranks compare lower measurements with lower measurements. True while one is in
        flight. One that cannot be measured again (no committed text, no answer in time, no
        rounds left) keeps counting at the ceiling, as before: never above a confirmed
        figure."""
        s, key = self.store, confirm.STATE_PREFIX + group.id
        if state.waiting is not None:
            if not overdue:
                return True
            metrics.CONFIRMATIONS.labels("timed_out").inc()
            log.warning(
                "group runner-up's second measurement did not come; it counts at the ceiling",
                group=group.id,
                result=state.waiting,
            )
            state.waiting = None
            s.set(key, state.to_json())
            return False
        if state.round >= self.section.confirm_rounds:
            return False
        ceiling = state.ceiling
        assert ceiling is not None
        majority = majority_class(results)
        above = [
            r
            for r in results
            if r.status == "success"
            and r.gflops is not None
            and r.gflops > ceiling
            and r.host.host_class == majority
            and r.source is not None
            and r.id not in state.confirmed
            and r.id not in state.dropped
        ]
        if not above:
            return False
        runner_up = max(above, key=lambda r: (r.gflops or 0.0, -r.index))
        text = self._committed_text(runner_up)
        if text is None and self.section.require_committed_text:
            return False
        self._request_confirmation(group, state, runner_up, text, now, reason)
        return True

    def _committed_text(self, result: BenchResult) -> str | None:
        """The text the generator committed to for ``result``'s candidate, if it did."""
        return self.store.committed_text(
            result.id,
            rollout_sha256=None if result.rollout is None else rollout_sha256(result.rollout),
            completion_sha256=result.completion_sha256,
        )

    def _request_confirmation(
        self,
        group: GroupRow,
        state: confirm.ConfirmState,
        first: BenchResult,
        text: str | None,
        now: float,
        reason: CloseReason,
    ) -> None:
        """Send ``first`` to be measured again: its committed ``text``, or (None) the source
        it reports. State and request in one transaction (the caller's)."""
        s, key = self.store, confirm.STATE_PREFIX + group.id
        state.round += 1
        state.waiting = first.id
        state.reason = reason
        state.from_text = text is not None
        candidate = confirm.confirmation(
            first, group.id, state.round, text, task=self.bench_of(group).task
        )
        state.confirm_group = candidate.group_id
        s.set(key, state.to_json())
        s.set(confirm.INDEX_PREFIX + candidate.group_id, group.id)
        s.enqueue(CODE_TO_BENCH, candidate)
        s.note_progress(group.id, now)  # the deadline runs from the request
        metrics.CONFIRMATIONS.labels("requested").inc()
        log.info(
            "group winner sent for a second measurement",
            group=group.id,
            result=first.id,
            gflops=first.gflops,
            round=state.round,
            runner_up=bool(state.confirmed),
            benchmarker=first.benchmarker,
            committed_text=state.from_text,
        )

    def _note_publisher(self, result: BenchResult, publisher: str | None) -> None:
        """Which broker user sent a result, and which users have hosts of its class."""
        if publisher is None:
            return
        s = self.store
        s.set(confirm.PUBLISHER_PREFIX + result.id, publisher)
        key = confirm.CLASS_USERS_PREFIX + result.host.host_class
        users: list[str] = s.get(key, [])
        if publisher not in users and len(users) < confirm.MAX_CLASS_USERS:
            s.set(key, [*users, publisher])

    def _handle_confirmation(
        self, group_id: str, result: BenchResult, now: float, publisher: str | None = None
    ) -> None:
        s = self.store
        key = confirm.STATE_PREFIX + group_id
        state = confirm.ConfirmState.of(s.get(key))
        group = s.group(group_id)
        if (
            group is None
            or group.state == "closed"
            or state.waiting is None
            or state.confirm_group != result.group_id
        ):
            metrics.RESULTS_IGNORED.labels("duplicate").inc()  # answered already, or superseded
            return
        refused = self.peaks.admit(s, result)
        if refused is not None:
            metrics.RESULTS_IGNORED.labels("above_peak").inc()
            raise Reject(refused)
        first = next((r for r in s.results_of(group_id) if r.id == state.waiting), None)
        if first is None:  # cannot be: the winner was stored before it was sent
            raise Reject(f"confirmation {result.id}: result {state.waiting} is not stored")
        self._note_publisher(result, publisher)
        verdict, why = confirm.judge(
            first, result, self.section.confirm_tolerance, from_text=state.from_text
        )
        first_user = s.get(confirm.PUBLISHER_PREFIX + first.id)
        if (
            verdict == "agreed"
            and publisher is not None
            and publisher == first_user
            and len(s.get(confirm.CLASS_USERS_PREFIX + first.host.host_class, [])) > 1
        ):
            # Another broker user has hosts of this class: a benchmarker credential must
            # not be the one to confirm its own claim (it reads code-to-bench too).
            verdict, why = (
                "inconclusive",
                (
                    f"confirmed by the same broker user {publisher!r} "
                    f"while another user has hosts of the class"
                ),
            )
        metrics.CONFIRMATIONS.labels(verdict).inc()
        if verdict == "agreed":
            # It counts at the lower of its two measurements, so no claim above what was
            # measured again survives, within the tolerance or not; and no other result of
            # the group above it (ConfirmState.apply).
            state.confirmed.append(first.id)
            if result.gflops is not None and first.gflops is not None:
                state.adjusted[first.id] = min(first.gflops, result.gflops)
            log.info(
                "group winner confirmed",
                group=group_id,
                result=first.id,
                detail=why,
                by=result.benchmarker,
            )
        elif verdict == "disagreed":
            state.dropped.append(first.id)
            self._mark_suspect(first, result, why, now)
        else:
            log.info(
                "group winner's second measurement not comparable; another round",
                group=group_id,
                result=first.id,
                detail=why,
            )
        state.waiting = None
        s.set(key, state.to_json())
        s.note_progress(group_id, now)
        self._close(group, now, state.reason)  # type: ignore[arg-type]

    def _mark_suspect(self, first: BenchResult, second: BenchResult, why: str, now: float) -> None:
        s = self.store
        metrics.SUSPECT_RESULTS.inc(2)
        suspects: dict[str, dict] = s.get(confirm.SUSPECTS_KEY, {})
        host = confirm.host_key(first)
        entry = suspects.get(host, {"count": 0})
        entry.update(
            count=int(entry["count"]) + 1,
            last_result=first.id,
            second_result=second.id,
            second_by=confirm.host_key(second),
            reason=why[:500],
            at=now,
        )
        suspects[host] = entry
        if len(suspects) > confirm.MAX_SUSPECT_HOSTS:
            del suspects[min(suspects, key=lambda h: suspects[h].get("at", 0))]
        s.set(confirm.SUSPECTS_KEY, suspects)
        metrics.SUSPECT_HOSTS.set(len(suspects))
        log.warning(
            "a winner's second measurement disagrees: both results and the reporting "
            "host are suspect",
            result=first.id,
            gflops=first.gflops,
            host=host,
            second=second.id,
            second_status=second.status,
            second_gflops=second.gflops,
            second_host=confirm.host_key(second),
            reason=why,
        )

    def suspect_hosts(self) -> dict[str, dict]:
        return dict(self.store.get(confirm.SUSPECTS_KEY, {}))

    def _close(
        self, group: GroupRow, now: float, reason: CloseReason, overdue: bool = False
    ) -> None:
        s, exp = self.store, self.config.experiment
        results = s.results_of(group.id)
        dropped = 0
        if self.section.confirm_winners:
            if self._confirming(group, results, now, reason, overdue):
                return
            state = confirm.ConfirmState.of(s.get(confirm.STATE_PREFIX + group.id))
            dropped, results = len(state.dropped), state.apply(results)
        closed = close_group(
            group.id,
            results,
            experiment=exp.name,
            iteration=group.iteration,
            reward_mode=self.section.reward_mode,
            parent=parent_of(s.program(group.parent_id)),
            success_scale=self.section.success_scale,
        )
        # An anchor's children are trained on but stay out of the pool: SQD's lineage is the
        # policy's own.
        joins_pool = not is_anchor(group.parent_id)
        for result in closed.kept:
            reward = closed.rewards[result.id]
            s.record_reward(result.id, reward)
            if joins_pool:
                s.add_program(
                    Program(
                        id=result.id,
                        stage=group.target_stage,
                        status=result.status,
                        source=result.source,
                        gflops=result.gflops,
                        reward=reward,
                        error=result.error,
                        parent_id=group.parent_id,
                        mode=group.mode,
                        iteration=group.iteration,
                        host_class=result.host.host_class,
                        techniques=tuple(result.techniques),
                        task=group.task,
                    ),
                    group.id,
                )
            if result.gflops is not None:
                metrics.GFLOPS.labels(self.task_label(group.task), str(group.target_stage)).observe(
                    result.gflops
                )
        outcome: BatchOutcome
        if closed.batch is not None and group.target_stage < self.section.train_from_stage:
            outcome = "below_train_stage"
        elif closed.batch is not None:
            s.enqueue(ROLLOUT_BATCHES, closed.batch)
            outcome = "sent"
        else:
            outcome = "no_rollout" if closed.kept else "empty"
        s.forget_commitments(group.id)
        for held in s.held_results_of_group(group.id):  # undecided: they never count now
            s.release_held(held.seq)
            metrics.RESULTS_IGNORED.labels("late").inc()
        s.mark_closed(
            group.id,
            at=now,
            reason=reason,
            outcome=outcome,
            host_class=closed.host_class,
            excluded=len(closed.excluded) + dropped,
            reward_mean=closed.reward_mean,
            reward_max=closed.reward_max,
        )
        metrics.GROUPS_CLOSED.labels(reason).inc()
        metrics.BATCHES.labels(outcome).inc()
        metrics.EXCLUDED.inc(len(closed.excluded))
        metrics.NO_ROLLOUT.inc(closed.skipped_no_rollout)
        if closed.excluded:
            log.warning(
                "mixed host classes in a group; minority excluded",
                group=group.id,
                kept=closed.host_class,
                excluded=sorted({r.host.host_class for r in closed.excluded}),
            )
        if closed.reward_mean is not None:
            metrics.GROUP_REWARD_MEAN.observe(closed.reward_mean)
            metrics.GROUP_REWARD_MAX.observe(closed.reward_max or 0.0)
        if group.published_at is not None:
            metrics.GROUP_SECONDS.observe(max(0.0, now - group.published_at))
        log.info(
            "group closed",
            group=group.id,
            reason=reason,
            kept=len(closed.kept),
            outcome=outcome,
            reward_mean=closed.reward_mean,
            reward_max=closed.reward_max,
        )

    # --- metrics from the store (restart-proof gauges) --------------------------------

    def task_label(self, task: str) -> str:
        """A task's ``task`` label: its name (a task given by path is labelled by the name
        its TOML declares, so a label stays short and one per task)."""
        spec = self.tasks.get(task)
        return spec.name if spec is not None else task

    def refresh_metrics(self) -> None:
        s = self.store
        t = self.iteration()
        metrics.ITERATION.set(max(t, 0))
        metrics.ITERATIONS.set(self.section.iterations)
        metrics.ITERATIONS_DONE.set(self.iterations_done())
        for state, count in s.count_groups_by_state(t).items():
            metrics.GROUPS.labels(state).set(count)
        pacing = self.pacing_state()
        metrics.IN_FLIGHT.set(pacing.groups_in_flight)
        metrics.OUTSTANDING.set(outstanding(pacing))
        metrics.POLICY_VERSION.set(int(s.get("policy_version", 0)))
        metrics.GROUPS_TRAINED.set(pacing.groups_trained)
        metrics.UNSENT.set(s.count_unsent())
        metrics.RESULTS_HELD.set(s.count_held())
        metrics.SUSPECT_HOSTS.set(len(self.suspect_hosts()))
        metrics.POOL.clear()
        for program in dedupe(s.pool(t)):
            metrics.POOL.labels(
                self.task_label(program.task), str(program.stage), program.status
            ).inc()
        for (task, iteration, stage), values in s.gflops_by_task_iteration_and_stage().items():
            labels = (self.task_label(task), str(stage), str(iteration))
            metrics.BEST_GFLOPS.labels(*labels).set(max(values))
            metrics.MEDIAN_GFLOPS.labels(*labels).set(statistics.median(values))
        for (task, stage), best in s.best_gflops_by_task_and_stage().items():
            metrics.BEST_GFLOPS_STAGE.labels(self.task_label(task), str(stage)).set(best)
        for iteration, (mean, best_reward) in s.reward_stats_by_iteration().items():
            metrics.ITERATION_REWARD_MEAN.labels(str(iteration)).set(mean)
            metrics.ITERATION_REWARD_MAX.labels(str(iteration)).set(best_reward)
