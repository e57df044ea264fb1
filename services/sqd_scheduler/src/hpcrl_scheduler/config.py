"""The ``[scheduler]`` section of the experiment config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from hpcrl_common.config import ServiceConfig, related_default
from hpcrl_common.rewards import MAX_SUCCESS_SCALE
from hpcrl_common.service import ServiceSection
from hpcrl_common.stages import FIRST_STAGE, LAST_STAGE
from hpcrl_scheduler.groups import PAPER_SUCCESS_SCALE, RewardMode
from hpcrl_scheduler.selection import Ratios


class SchedulerSection(ServiceSection):
    metrics_port: int = Field(9104, ge=0, le=65535, description="0 picks a free port")
    iterations: int = Field(9, ge=1, le=10_000, description="T: SQD iterations to run")
    group_size: int = Field(
        16, ge=1, le=1024, description="G: completions per node (the paper: 64)"
    )
    node_budget: int = Field(
        32, ge=0, description="nodes expanded per iteration besides the seed (0 = unbounded)"
    )
    ratio_deepen: float = Field(
        Ratios.deepen,
        ge=0,
        description="share of a stage's successes (top) deepened; weight of deepen in the budget",
    )
    ratio_improve: float = Field(
        Ratios.improve,
        ge=0,
        description="share of successes (next) improved; weight of improve in the budget",
    )
    ratio_repair: float = Field(
        Ratios.repair, ge=0, description="weight of repair in the budget (0 = no repairs)"
    )
    reward_mode: RewardMode = Field(
        "group_normalized",
        description="success reward: raw = GFLOPS (Experiment 1); group_normalized = GFLOPS / "
        "group max x success_scale (Experiment 2); parent_relative = 100 x GFLOPS / parent "
        "GFLOPS - 100, at least -9, a copy of the parent 0, group_normalized where the parent "
        "has no GFLOPS (seed, repair); failures keep their penalty",
    )
    success_scale: float = Field(
        PAPER_SUCCESS_SCALE,
        gt=0,
        le=MAX_SUCCESS_SCALE,
        description="what a group's fastest success earns where successes are "
        "group-normalised (the paper: 100); failures keep their penalty, so a larger scale "
        "makes a fast but risky kernel worth its failures (500 measured on the demo: no "
        "faster best kernel)",
    )
    train_from_stage: int = Field(
        FIRST_STAGE,
        ge=FIRST_STAGE,
        le=LAST_STAGE,
        description="only groups whose target stage is at least this are sent to the "
        "learner; lower stages still fill the pool and earn rewards (the policy then learns "
        "only where the fast kernels are written; the default trains on every stage)",
    )
    restyle_parents: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of seed, deepen and improve prompts whose parent is shown "
        "restyled (renamed variables and tile macros, other indentation and comments; the "
        "program unchanged), as the bootstrap shows three in five of its parents; repair "
        "prompts never (0 = every parent as written)",
    )
    anchor_nodes: int = Field(
        0,
        ge=0,
        description="nodes of each iteration whose parent is a correct kernel of "
        "anchor_corpus (parents the policy did not write), deepened or improved at every stage "
        "in turn; taken out of node_budget; their children are trained on but do not join the "
        "pool (0 = off; one task only)",
    )
    anchor_corpus: Path | None = Field(
        None,
        description="the anchors' kernels: a corpus.json as hpcrl-bootstrap writes it beside "
        "the policy (rows of stage, status, source); the demo sets it to its policy's",
    )
    isa: Literal["avx512", "avx2"] = Field(
        "avx512", description="the benchmark hosts' best ISA, named in prompts"
    )
    db_path: Path | None = Field(
        None, description="SQLite file (default: <data_dir>/scheduler/<experiment>.sqlite)"
    )
    seed_program: Path | None = Field(
        None, description="C file of the seed program (default: the built-in one of the task)"
    )
    prompt_templates: Path | None = Field(
        None,
        description="TOML with the prompt templates: keys system, user, "
        "modes.{seed,deepen,improve,repair} (default: built-in)",
    )
    temperature: float = Field(1.0, ge=0, le=10, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    max_tokens: int = Field(1024, ge=1, le=65_536, description="completion length limit")
    max_groups_in_flight: int = Field(
        64, ge=0, description="requests published but not yet closed (0 = no bound)"
    )
    max_staleness: int = Field(
        related_default("scheduler.max_staleness"),
        ge=0,
        description="steps generation may run ahead of learning (0 = off)",
    )
    initial_groups_per_step: int = Field(
        related_default("scheduler.initial_groups_per_step"),
        ge=1,
        description="the learner's groups per step, assumed until its first update",
    )
    version_floor: bool = Field(
        True, description="requests ask for at least the latest policy version seen"
    )
    checkpoint_dir: Path | None = Field(
        related_default("scheduler.checkpoint_dir"),
        description="the learner's checkpoint store (manifest.json): a weight-update sets the "
        "floor and the pacing figures only if this store's manifest holds its version, run "
        "and checksum (others are dead-lettered); unset: learner.checkpoint_dir of the same "
        "config file, and without one every weight-update is refused",
    )
    max_version_jump: int = Field(
        64,
        ge=1,
        description="a weight-update more than this many versions above the floor "
        "is dead-lettered even when the store holds it (announcements arrive one per version "
        "on the scheduler's durable queue)",
    )
    pacing_hold_deadline_s: float = Field(
        1800.0,
        gt=0,
        description="pacing that holds every pending request this long with "
        "no group in flight makes /healthz 503, the reason in its detail",
    )
    group_deadline_s: float = Field(
        1800.0, gt=0, description="a group with no new result for this long is closed short"
    )
    tick_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="period of the scheduling loop (plan, admit, deadlines, outbox)",
    )
    exit_when_done: bool = Field(True, description="serve exits 0 once all T iterations end")
    host_peaks: dict[str, Annotated[float, Field(gt=0)]] = Field(
        {},
        description="the operator's peak GFLOPS per host class (key: the class, or the CPU "
        "model for all its classes); wins over what results report. Unlisted classes: the "
        "lowest peak reported, capped by cores x max_clock_ghz x FLOPs/cycle of the ISA; a "
        "result above its class's peak is dead-lettered",
    )
    max_clock_ghz: float = Field(
        6.0,
        gt=0,
        le=20,
        description="clock of the peak formula for host classes not in host_peaks (an upper bound)",
    )
    max_host_cores: int = Field(
        1024,
        ge=1,
        description="cores counted at most by the peak formula, whatever a result reports",
    )
    confirm_winners: bool = Field(
        True,
        description="a group's best success is benchmarked again (another replica "
        "first, then any) before the group's rewards, pool and lineage take it, at the lower "
        "of its two measurements; a disagreement drops it and marks both results and the "
        "host suspect",
    )
    confirm_tolerance: float = Field(
        2.0,
        ge=0,
        description="a winner is suspect (dropped, host marked) when its GFLOPS "
        "exceed the second measurement's by more than this share (2.0: 3x; timing on a busy "
        "node differs up to 2x); within it, the winner counts at the lower measurement",
    )
    confirm_rounds: int = Field(
        3,
        ge=1,
        le=16,
        description="re-measurements per group at "
        "most (each dropped winner's successor is confirmed too)",
    )
    confirm_without_source: Literal["drop", "count"] = Field(
        "drop",
        description="a group winner that came without its source cannot be measured "
        "again: drop it (its successor is confirmed instead); count: take it unconfirmed "
        "(only for benchmarkers run with include_source = false, whose every result lacks "
        "it: then one benchmarker credential can set a group's maximum)",
    )

    require_commitments: bool = Field(
        True,
        description="file a result's token data only against the generator's commitment "
        "to its candidate (candidate-commitments); a result whose commitment has not come "
        "within commitment_wait_s is dead-lettered. false: such a result is filed unchecked "
        "(generators of an older release during a rolling upgrade). A commitment that does "
        "not match dead-letters the result either way",
    )
    require_committed_text: bool = Field(
        True,
        description="a group winner is measured again from the text the generator committed "
        "to for its candidate (candidate-commitment/2), and its reported source must be what "
        "that text yields; a winner without a committed text is dropped (its successor "
        "confirmed). false: such a winner is measured again from the source it reports "
        "(generators of an older release, committing with candidate-commitment/1, during a "
        "rolling upgrade)",
    )
    commitment_wait_s: float = Field(
        300.0,
        gt=0,
        description="how long a result that came before its candidate's commitment is held "
        "for it (it counts in its group only once decided)",
    )

    @model_validator(mode="after")
    def _ratios(self) -> SchedulerSection:
        if self.ratio_deepen + self.ratio_improve + self.ratio_repair <= 0:
            raise ValueError("ratio_deepen + ratio_improve + ratio_repair must be positive")
        if self.node_budget and self.anchor_nodes >= self.node_budget:
            raise ValueError(
                f"anchor_nodes ({self.anchor_nodes}) must be below node_budget "
                f"({self.node_budget}): anchors come out of the budget, SQD needs the rest"
            )
        return self


class SchedulerConfig(ServiceConfig):
    scheduler: SchedulerSection = SchedulerSection()

    @property
    def db_path(self) -> Path:
        if self.scheduler.db_path is not None:
            return self.scheduler.db_path
        return self.experiment.data_dir / "scheduler" / f"{self.experiment.name}.sqlite"
