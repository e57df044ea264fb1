"""Builds hpcrl's Grafana dashboards as code and writes them to deploy/grafana/dashboards/.

    .venv/bin/python deploy/grafana/build_dashboards.py            # (re)write the JSON files
    .venv/bin/python deploy/grafana/build_dashboards.py --check    # exit 1 if they are stale
    .venv/bin/python deploy/grafana/build_dashboards.py --markdown # panel list for the README

The JSON files are committed so that Grafana's file provisioning can load them without Python;
tests/observability checks that they equal what this script generates and that every query
names only metrics the services export.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, stat, table, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DataSourceRef, DataTransformerConfig, Panel
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="hpcrl-prometheus")
# Job names of deploy/prometheus/prometheus.yml; the broker metrics are shared by all services,
# so their queries select the service by job.
JOB_GENERATOR = "hpcrl-generator"
JOB_BENCHMARKER = "hpcrl-benchmarker"
JOB_LEARNER = "hpcrl-learner"
JOB_SCHEDULER = "hpcrl-scheduler"
RATE = "$__rate_interval"
TAGS = ["hpcrl"]


@dataclass
class Query:
    expr: str
    legend: str = ""
    instant: bool = False  # tables and bar gauges show the latest value, not a history


@dataclass
class PanelSpec:
    """One panel, kept as data so that the README's panel list comes from the same source."""

    kind: str  # timeseries, stat, table, bargauge
    title: str
    description: str
    queries: list[Query]
    unit: str = ""
    width: int = 8
    height: int = 8
    stacked: bool = False
    renames: dict[str, str] = field(default_factory=dict)  # table columns
    hide: tuple[str, ...] = ("job", "instance")  # table columns


@dataclass
class DashboardSpec:
    uid: str
    title: str
    description: str
    rows: list[tuple[str, list[PanelSpec]]]

    def panels(self) -> Iterable[PanelSpec]:
        for _row, panels in self.rows:
            yield from panels


def q(expr: str, legend: str = "", *, instant: bool = False) -> Query:
    return Query(expr, legend, instant)


def quantiles(
    metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.95), selector: str = ""
) -> list[Query]:
    labels = ", ".join(["le", *([by] if by else [])])
    legend_by = "".join(f" {{{{{label.strip()}}}}}" for label in by.split(",")) if by else ""
    return [
        q(
            f"histogram_quantile({x}, sum by ({labels}) (rate({metric}_bucket{selector}[{RATE}])))",
            f"p{round(x * 100)}{legend_by}",
        )
        for x in qs
    ]


def ts(
    title: str,
    description: str,
    *queries: Query,
    unit: str = "",
    width: int = 8,
    stacked: bool = False,
) -> PanelSpec:
    return PanelSpec("timeseries", title, description, list(queries), unit, width, stacked=stacked)


def single(
    title: str, description: str, expr: str, unit: str = "", width: int = 4, legend: str = ""
) -> PanelSpec:
    return PanelSpec("stat", title, description, [q(expr, legend)], unit, width, height=4)


# --- experiment overview -----------------------------------------------------------------


def experiment() -> DashboardSpec:
    progress = [
        single(
            "Iteration",
            "Current SQD iteration (0-based) of the scheduler.",
            "hpcrl_scheduler_iteration",
        ),
        single(
            "Iterations done",
            "Iterations of the run completed so far.",
            "hpcrl_scheduler_iterations_done",
            legend="done",
        ),
        single(
            "Iterations planned",
            "T: the iterations this run will do.",
            "hpcrl_scheduler_iterations",
        ),
        single(
            "Best GFLOPS so far",
            "Best GFLOPS of any stage over the whole run, per task (one in a run of one task).",
            "max by (task) (hpcrl_scheduler_best_gflops_overall)",
            legend="{{task}}",
        ),
        single(
            "Groups in flight",
            "Generation requests published whose group is not closed.",
            "hpcrl_scheduler_groups_in_flight",
        ),
        single(
            "Policy version",
            "Latest policy version the scheduler has seen announced.",
            "hpcrl_scheduler_policy_version",
        ),
        ts(
            "Groups of the current iteration",
            "Groups of the current iteration by state "
            "(pending, published = in flight, closed), groups in flight and groups published "
            "but not yet trained on, and requests held back by pacing (by reason).",
            q("hpcrl_scheduler_groups", "{{state}}"),
            q("hpcrl_scheduler_groups_in_flight", "in flight"),
            q("hpcrl_scheduler_groups_outstanding", "outstanding (not trained on)"),
            q("hpcrl_scheduler_requests_held", "held: {{reason}}"),
            width=12,
        ),
        ts(
            "Requests by mode",
            "Generation requests published per second by expansion mode "
            "(seed, deepen, improve, repair).",
            q(f"sum by (mode) (rate(hpcrl_scheduler_requests_total[{RATE}]))", "{{mode}}"),
            unit="reqps",
            width=12,
            stacked=True,
        ),
    ]
    rewards = [
        ts(
            "Reward per iteration (mean, max)",
            "Mean and max reward over the samples of the "
            "closed groups of each iteration (the paper's reward curve, one line per "
            "iteration).",
            q("hpcrl_scheduler_iteration_reward_mean", "mean, iteration {{iteration}}"),
            q("hpcrl_scheduler_iteration_reward_max", "max, iteration {{iteration}}"),
        ),
        PanelSpec(
            "table",
            "Reward per iteration (table)",
            "Latest mean and max reward of each iteration, one row per iteration.",
            [
                q("hpcrl_scheduler_iteration_reward_mean", instant=True),
                q("hpcrl_scheduler_iteration_reward_max", instant=True),
            ],
            renames={"Value #A": "reward mean", "Value #B": "reward max"},
        ),
        ts(
            "Group rewards (per closed group)",
            "Average over the groups closed in the window of "
            "each group's mean reward and of each group's max reward, and the median group "
            "max.",
            q(
                f"rate(hpcrl_scheduler_group_reward_mean_sum[{RATE}]) / "
                f"rate(hpcrl_scheduler_group_reward_mean_count[{RATE}])",
                "group mean (avg)",
            ),
            q(
                f"rate(hpcrl_scheduler_group_reward_max_sum[{RATE}]) / "
                f"rate(hpcrl_scheduler_group_reward_max_count[{RATE}])",
                "group max (avg)",
            ),
            *quantiles("hpcrl_scheduler_group_reward_max", qs=(0.5,)),
        ),
        ts(
            "Reward per learner step",
            "Mean and max reward over the groups of the learner's "
            "last GRPO step, and the std of their advantages.",
            q("hpcrl_learner_reward_mean", "mean"),
            q("hpcrl_learner_reward_max", "max"),
            q("hpcrl_learner_advantage_std", "advantage std"),
            width=24,
        ),
    ]
    gflops = [
        ts(
            "Best GFLOPS per stage (whole run)",
            "Best GFLOPS of each task and stage over the run so far.",
            q("hpcrl_scheduler_best_gflops_overall", "{{task}} stage {{stage}}"),
            unit="GFLOPS",
        ),
        ts(
            "Best GFLOPS per iteration",
            "Best GFLOPS over all stages of each iteration's pool, per task (the paper's "
            "best-GFLOPS curve).",
            q(
                "max by (task, iteration) (hpcrl_scheduler_best_gflops)",
                "{{task}} iteration {{iteration}}",
            ),
            unit="GFLOPS",
        ),
        ts(
            "Median GFLOPS per stage and iteration",
            "Median GFLOPS of the successful programs of each task and stage in each iteration.",
            q(
                "hpcrl_scheduler_median_gflops",
                "{{task}} stage {{stage}}, iteration {{iteration}}",
            ),
            unit="GFLOPS",
        ),
        PanelSpec(
            "table",
            "Best and median GFLOPS per stage and iteration",
            "One row per (task, stage, iteration) of the pool: best and median GFLOPS of its "
            "successes.",
            [
                q("hpcrl_scheduler_best_gflops", instant=True),
                q("hpcrl_scheduler_median_gflops", instant=True),
            ],
            unit="GFLOPS",
            width=12,
            renames={"Value #A": "best GFLOPS", "Value #B": "median GFLOPS"},
        ),
        ts(
            "GFLOPS of successful programs",
            "Distribution of the GFLOPS of the successes filed "
            "in the window, by task and target stage (median and 95th percentile).",
            *quantiles("hpcrl_scheduler_gflops", by="task, stage"),
            unit="GFLOPS",
            width=12,
        ),
    ]
    outcomes = [
        ts(
            "Outcome mix by status",
            "Results filed per second by status (success, "
            "compile_error, verification_error, timeout, ...), stacked.",
            q(f"sum by (status) (rate(hpcrl_scheduler_results_total[{RATE}]))", "{{status}}"),
            unit="ops",
            stacked=True,
        ),
        PanelSpec(
            "bargauge",
            "Outcome counts",
            "Results filed since the scheduler started, by status.",
            [q("sum by (status) (hpcrl_scheduler_results_total)", "{{status}}", instant=True)],
        ),
        ts(
            "Pool size per stage",
            "Programs (deduplicated) in the pool being built, by task and stage; "
            "successes and failures together.",
            q("sum by (task, stage) (hpcrl_scheduler_pool_programs)", "{{task}} stage {{stage}}"),
            stacked=True,
        ),
        ts(
            "Results not filed",
            "Results ignored (duplicate, late) or excluded from their group "
            "(minority host class), and groups closed by reason, per second.",
            q(
                f"sum by (reason) (rate(hpcrl_scheduler_results_ignored_total[{RATE}]))",
                "ignored: {{reason}}",
            ),
            q(f"rate(hpcrl_scheduler_results_excluded_total[{RATE}])", "excluded"),
            q(
                f"sum by (reason) (rate(hpcrl_scheduler_groups_closed_total[{RATE}]))",
                "groups closed: {{reason}}",
            ),
            unit="ops",
            width=12,
        ),
        ts(
            "Group time",
            "Time from a request's publication to its group's closing (median "
            "and 95th percentile).",
            *quantiles("hpcrl_scheduler_group_seconds"),
            unit="s",
            width=12,
        ),
    ]
    # A process's busiest client, then the mean over a service's replicas (README, "Metrics").
    busy = f"avg by (job) (max by (job, instance) (rate(hpcrl_service_busy_seconds_total[{RATE}])))"
    overlap = [
        ts(
            "Service busy fraction",
            "Share of wall time each service worked on at least one "
            "item (overlapping items once; a generator request waiting for a policy version "
            "does not count), mean over its replicas: the service near 100 % paces the loop.",
            q(busy, "{{job}}"),
            unit="percentunit",
            width=16,
        ),
        single(
            "Wall / busiest service",
            "Wall time over the busiest service's busy time in "
            "the window: 1.0 when the slowest service never waits for another (the demo's "
            "overlap figure; target ≤ 1.1).",
            f"1 / max({busy})",
            width=8,
        ),
    ]
    return DashboardSpec(
        "hpcrl-experiment",
        "hpcrl: experiment overview",
        "SQD progress, reward curves, GFLOPS per stage and iteration, outcome mix, how well "
        "the services overlap.",
        [
            ("Progress", progress),
            ("Rewards", rewards),
            ("GFLOPS", gflops),
            ("Outcomes and pool", outcomes),
            ("Overlap", overlap),
        ],
    )


# --- benchmarker fleet -------------------------------------------------------------------


def backlog(queue: str) -> str:
    """Messages published to a work queue minus those settled off it, over every scraped
    process: the queue's depth (ready + unacked) as the services see it. A service restart
    resets its counters, so the figure is exact only between restarts."""
    return (
        f'sum(hpcrl_broker_published_total{{routing_key=~".*{queue}"}}) - '
        f'sum(hpcrl_broker_consumed_total{{queue=~".*{queue}", '
        f'outcome=~"acked|dead_lettered"}})'
    )


def fleet() -> DashboardSpec:
    bench = f'{{job="{JOB_BENCHMARKER}"}}'
    overview = [
        single(
            "Replicas up",
            "Benchmarker replicas that Prometheus scrapes successfully.",
            f"count(up{bench} == 1)",
        ),
        single(
            "In flight",
            "Candidates being benchmarked now, over the fleet.",
            "sum(hpcrl_benchmarker_inflight)",
        ),
        single(
            "Results/s",
            "Verdicts published per second over the fleet.",
            f"sum(rate(hpcrl_benchmarker_results_total[{RATE}]))",
            unit="ops",
        ),
        single(
            "code-to-bench backlog",
            "Candidates waiting in or being taken off "
            "code-to-bench (published minus settled; needs the generators scraped too).",
            backlog("code-to-bench"),
        ),
        single(
            "Sandbox kills",
            "Sandboxed processes killed at their wall-clock limit since the replicas started.",
            "sum(hpcrl_benchmarker_sandbox_kills_total)",
        ),
        single(
            "Result lag p95",
            "95th percentile of the time from a result's creation by a "
            "benchmarker to its filing by the scheduler.",
            f"histogram_quantile(0.95, sum by (le) "
            f"(rate(hpcrl_scheduler_result_lag_seconds_bucket[{RATE}])))",
            unit="s",
        ),
    ]
    throughput = [
        ts(
            "Results by status",
            "Verdicts published per second over the fleet, by status.",
            q(f"sum by (status) (rate(hpcrl_benchmarker_results_total[{RATE}]))", "{{status}}"),
            unit="ops",
            stacked=True,
        ),
        ts(
            "Results by task",
            "Verdicts published per second over the fleet, by task (a replica serves every "
            "task it is allowed: matmul, gemv, stencil, spmv or a task of one's own).",
            q(f"sum by (task) (rate(hpcrl_benchmarker_results_total[{RATE}]))", "{{task}}"),
            unit="ops",
            stacked=True,
        ),
        ts(
            "Results per replica",
            "Verdicts published per second by each replica.",
            q(f"sum by (instance) (rate(hpcrl_benchmarker_results_total[{RATE}]))", "{{instance}}"),
            unit="ops",
        ),
        ts(
            "In flight per replica",
            "Candidates each replica is benchmarking now.",
            q("hpcrl_benchmarker_inflight", "{{instance}}"),
        ),
    ]
    queues = [
        ts(
            "Queue depth",
            "Messages in code-to-bench and bench-results: published minus "
            "settled (acked or dead-lettered), from the services' own broker counters.",
            q(backlog("code-to-bench"), "code-to-bench"),
            q(backlog("bench-results"), "bench-results"),
        ),
        ts(
            "Result lag",
            "Time from a result's creation by a benchmarker to its filing by the "
            "scheduler (median, 95th percentile).",
            *quantiles("hpcrl_scheduler_result_lag_seconds"),
            unit="s",
        ),
        ts(
            "Redeliveries and dead letters",
            "Candidates a replica gave back for another try, "
            "dead-lettered, or saw again after they were done, per second.",
            q(
                f'sum by (outcome) (rate(hpcrl_broker_consumed_total{{job="{JOB_BENCHMARKER}", '
                f'outcome!="acked"}}[{RATE}]))',
                "{{outcome}}",
            ),
            unit="ops",
        ),
    ]
    durations = [
        ts(
            "Step durations (p50)",
            "Median duration of each pipeline step (extract, checks, compile, verify, time).",
            *quantiles("hpcrl_benchmarker_step_seconds", by="step", qs=(0.5,)),
            unit="s",
        ),
        ts(
            "Step durations (p95)",
            "95th percentile duration of each pipeline step.",
            *quantiles("hpcrl_benchmarker_step_seconds", by="step", qs=(0.95,)),
            unit="s",
        ),
        ts(
            "Time per candidate",
            "Handler time per candidate on the benchmarkers (whole "
            "pipeline, median and 95th percentile).",
            *quantiles("hpcrl_broker_handler_seconds", selector=bench),
            unit="s",
        ),
        ts(
            "Sandbox kills by reason",
            "Sandboxed processes killed at their wall-clock limit, per second, by reason.",
            q(
                f"sum by (reason) (rate(hpcrl_benchmarker_sandbox_kills_total[{RATE}]))",
                "{{reason}}",
            ),
            unit="ops",
            width=12,
        ),
        ts(
            "GFLOPS measured per replica",
            "Median GFLOPS of the successes each replica measured, per task: replicas of "
            "one host class should agree on a task.",
            q(
                "histogram_quantile(0.5, sum by (le, instance, task) "
                f"(rate(hpcrl_benchmarker_gflops_bucket[{RATE}])))",
                "p50 {{instance}} {{task}}",
            ),
            unit="GFLOPS",
            width=12,
        ),
    ]
    hosts = [
        PanelSpec(
            "table",
            "Hosts",
            "One row per replica: host class, CPU model, ISA, compiler "
            "and cores of the host it measures on.",
            [q("hpcrl_benchmarker_host_info", instant=True)],
            width=16,
            hide=("job", "Value"),
        ),
        ts(
            "Broker connection",
            "1 while each replica is connected to RabbitMQ; reconnections per second.",
            q(f"hpcrl_broker_connected{bench}", "{{instance}} connected"),
            q(
                f"sum by (instance) (rate(hpcrl_broker_reconnects_total{bench}[{RATE}]))",
                "{{instance}} reconnects/s",
            ),
        ),
    ]
    clients = [
        ts(
            "Client requests",
            "Outside trainers' reward requests (hpcrl-reward-client) taken per second, by client.",
            q(
                f"sum by (client) (rate(hpcrl_benchmarker_client_requests_total[{RATE}]))",
                "{{client}}",
            ),
            unit="ops",
        ),
        ts(
            "Client verdicts by status",
            "Verdicts sent to outside trainers' queues per second, by client and status.",
            q(
                f"sum by (client, status) (rate(hpcrl_benchmarker_client_verdicts_total[{RATE}]))",
                "{{client}} {{status}}",
            ),
            unit="ops",
            stacked=True,
        ),
        ts(
            "Client verdict latency",
            "From a reward request's creation to its verdict, by client (median, 95th percentile).",
            *quantiles("hpcrl_benchmarker_client_latency_seconds", by="client"),
            unit="s",
        ),
    ]
    return DashboardSpec(
        "hpcrl-benchmarkers",
        "hpcrl: benchmarker fleet",
        "Throughput, queue depth and lag, step durations, sandbox kills, per-host information, "
        "outside trainers' reward requests.",
        [
            ("Fleet", overview),
            ("Throughput", throughput),
            ("Queues", queues),
            ("Durations", durations),
            ("Hosts", hosts),
            ("Outside trainers", clients),
        ],
    )


# --- policy ------------------------------------------------------------------------------


def policy() -> DashboardSpec:
    version = [
        single(
            "Learner version",
            "Latest policy version the learner committed.",
            "hpcrl_learner_policy_version",
        ),
        single(
            "Oldest generator version",
            "Lowest policy version loaded by any generator.",
            "min(hpcrl_generator_policy_version)",
        ),
        single(
            "Generator lag (versions)",
            "How many versions the most behind generator is behind the learner.",
            "max(hpcrl_learner_policy_version) - min(hpcrl_generator_policy_version)",
        ),
        single(
            "Groups trained",
            "Groups the learner has trained on since version 0.",
            "hpcrl_learner_groups_trained",
        ),
        single(
            "Pending groups",
            "Groups received by the learner, waiting for a step.",
            "hpcrl_learner_pending_groups",
        ),
        single(
            "Skipped updates",
            "Steps whose update was skipped (non-finite gradient) since the learner started.",
            "hpcrl_learner_skipped_updates_total",
        ),
        ts(
            "Policy version",
            "Version committed by the learner, loaded by each generator, "
            "and seen by the scheduler.",
            q("hpcrl_learner_policy_version", "learner"),
            q("hpcrl_generator_policy_version", "generator {{instance}}"),
            q("hpcrl_scheduler_policy_version", "scheduler"),
        ),
        ts(
            "Staleness",
            "Versions between the learner and the oldest sample of each consumed "
            "group (median, 95th percentile), and groups dropped as too stale per second.",
            *quantiles("hpcrl_learner_staleness"),
            q(f"rate(hpcrl_learner_stale_groups_dropped_total[{RATE}])", "dropped/s"),
        ),
        ts(
            "Steps",
            "Optimizer steps per second and the step time (train, save, commit; median).",
            q(f"rate(hpcrl_learner_steps_total[{RATE}])", "steps/s"),
            *quantiles("hpcrl_learner_step_seconds", qs=(0.5,)),
        ),
    ]
    training = [
        ts("Loss", "GRPO loss of the last step.", q("hpcrl_learner_loss", "loss")),
        ts(
            "KL",
            "k3 KL estimate per token of the policy against the reference, version 0 "
            "(absent when beta = 0: no reference is loaded) and of the sampling policy against "
            "the trainer: over all samples, and "
            "over fresh ones only (drawn from the trainer's current weights: about 0 unless the "
            "generators sample with stale weights).",
            q("hpcrl_learner_kl", "KL(policy || reference)"),
            q("hpcrl_learner_sampler_kl", "KL(sampler || trainer)"),
            q("hpcrl_learner_sampler_kl_fresh", "KL(sampler || trainer), fresh samples"),
        ),
        ts(
            "Grad norm",
            "Global gradient norm before clipping, last step.",
            q("hpcrl_learner_grad_norm", "grad norm"),
        ),
        ts(
            "Policy entropy",
            "Mean entropy of the policy per completion token (nats), last "
            "step: a steady fall towards 0 is the policy collapsing onto few completions.",
            q("hpcrl_learner_entropy", "entropy"),
        ),
        ts(
            "Taught-set NLL",
            "Negative log-likelihood per token of taught examples under the policy: the held-out "
            "probe after each step (learner.probe_examples), and the last step's supervised "
            "replay examples (learner.replay_coef > 0; absent otherwise). Rising, the policy "
            "forgets what it was taught, on prompts its own samples (and so its KL) never "
            "cover.",
            q("hpcrl_learner_taught_nll", "held-out probe NLL"),
            q("hpcrl_learner_replay_nll", "replay NLL"),
        ),
        ts(
            "Zero-variance groups",
            "Share of the last step's groups whose rewards are all "
            "equal (every sample failed alike, or all equally good): they carry no preference "
            "and move nothing (learner.skip_zero_variance_groups leaves them untrained).",
            q("hpcrl_learner_zero_variance_group_fraction", "zero-variance groups"),
            unit="percentunit",
        ),
        ts(
            "Clip and mask fractions",
            "Fraction of tokens whose ratio was clipped, and of "
            "tokens masked for a too large log-ratio to the sampling policy.",
            q("hpcrl_learner_clip_fraction", "clipped"),
            q("hpcrl_learner_masked_token_fraction", "masked"),
            unit="percentunit",
        ),
        ts(
            "Learning rate",
            "Learning rate of the last step.",
            q("hpcrl_learner_learning_rate", "lr"),
        ),
        ts(
            "Learner tokens/s",
            "Completion tokens per second of the last step's training.",
            q("hpcrl_learner_tokens_per_second", "tokens/s"),
        ),
    ]
    generation = [
        ts(
            "Generator tokens/s",
            "Completion tokens sampled per second by each generator.",
            q(f"sum by (instance) (rate(hpcrl_generator_tokens_total[{RATE}]))", "{{instance}}"),
        ),
        ts(
            "Request time",
            "Time of the engine call that sampled a request's G completions, "
            "with the groups batched with it (median, 95th percentile).",
            *quantiles("hpcrl_generator_request_seconds"),
            unit="s",
        ),
        ts(
            "Groups per engine call",
            "Requests sampled together in one engine call (median, "
            "95th percentile): near 1 while requests trickle in, up to "
            "generator.max_batch_groups when an iteration's requests arrive together.",
            *quantiles("hpcrl_generator_batch_groups"),
        ),
        ts(
            "Requests by outcome",
            "Generate requests per second by outcome (done, rejected, version_timeout, failed).",
            q(f"sum by (outcome) (rate(hpcrl_generator_requests_total[{RATE}]))", "{{outcome}}"),
            unit="reqps",
            stacked=True,
        ),
        ts(
            "Reload time",
            "Time to validate and load one policy version, by phase (95th percentile).",
            *quantiles("hpcrl_generator_reload_seconds", by="phase", qs=(0.95,)),
            unit="s",
        ),
        ts(
            "Reloads by outcome",
            "Policy versions offered for loading per second (loaded, refused, failed).",
            q(f"sum by (outcome) (rate(hpcrl_generator_reloads_total[{RATE}]))", "{{outcome}}"),
            unit="ops",
        ),
        ts(
            "Waits for a version",
            "Requests that waited for their policy-version floor per "
            "second, and how long they waited (95th percentile).",
            q(f"rate(hpcrl_generator_version_waits_total[{RATE}])", "waits/s"),
            *quantiles("hpcrl_generator_version_wait_seconds", qs=(0.95,)),
        ),
        ts(
            "Completions by finish reason",
            "Completions published per second by why they ended (stop, length).",
            q(
                f"sum by (finish_reason) (rate(hpcrl_generator_completions_total[{RATE}]))",
                "{{finish_reason}}",
            ),
            unit="ops",
        ),
    ]
    return DashboardSpec(
        "hpcrl-policy",
        "hpcrl: policy",
        "Policy version and staleness, GRPO loss, KL, grad norm, clipping, learning rate, "
        "generator throughput and weight reloads.",
        [("Version and staleness", version), ("Training", training), ("Generation", generation)],
    )


DASHBOARDS = (experiment, fleet, policy)


# --- rendering -----------------------------------------------------------------------------


def _target(query: Query, ref: str) -> prom.Dataquery:
    target = (
        prom.Dataquery()
        .expr(query.expr)
        .ref_id(ref)
        .datasource(DATASOURCE)
        .legend_format(query.legend or "__auto")
    )
    if query.instant:
        target = target.instant().format(PromQueryFormat.TABLE)
    return target


def _panel(spec: PanelSpec, panel_id: int) -> cogbuilder.Builder[Panel]:
    if spec.kind == "timeseries":
        builder = (
            timeseries.Panel()
            .fill_opacity(10 if not spec.stacked else 40)
            .legend(
                common_builders.VizLegendOptions()
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
                .show_legend(True)
            )
        )
        if spec.stacked:
            builder = builder.stacking(
                common_builders.StackingConfig().mode(common.StackingMode.NORMAL)
            )
    elif spec.kind == "stat":
        builder = (
            stat.Panel()
            .graph_mode(common.BigValueGraphMode.AREA)
            .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
        )
    elif spec.kind == "table":
        # Instant queries in table format give one frame per query; merge joins them on
        # their labels, so that one row holds e.g. the best and the median of one stage.
        hidden = ["Time", "__name__", *spec.hide]
        builder = (
            table.Panel()
            .show_header(True)
            .with_transformation(DataTransformerConfig(id_val="merge", options={}))
            .with_transformation(
                DataTransformerConfig(
                    id_val="organize",
                    options={
                        "excludeByName": dict.fromkeys(hidden, True),
                        "renameByName": spec.renames,
                    },
                )
            )
        )
    elif spec.kind == "bargauge":
        builder = (
            bargauge.Panel()
            .orientation(common.VizOrientation.HORIZONTAL)
            .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
        )
    else:
        raise ValueError(f"unknown panel kind {spec.kind!r}")
    builder = (
        builder.id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .span(spec.width)
        .height(spec.height)
    )
    if spec.unit:
        builder = builder.unit(spec.unit)
    refs = "ABCDEFGHIJ"
    for index, query in enumerate(spec.queries):
        builder = builder.with_target(_target(query, refs[index]))
    return builder


def build(spec: DashboardSpec) -> dash.Dashboard:
    board = (
        dash.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(TAGS)
        .refresh("10s")
        .time("now-3h", "now")
        .timezone("browser")
        .editable()
    )
    panel_id = 1
    for row_title, panels in spec.rows:
        board = board.with_row(dash.Row(row_title).id(panel_id))
        panel_id += 1
        for panel in panels:
            board = board.with_panel(_panel(panel, panel_id))
            panel_id += 1
    return board


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard, exactly as committed."""
    out = {}
    for make in DASHBOARDS:
        spec = make()
        text = json.dumps(build(spec).build(), cls=JSONEncoder, indent=2, sort_keys=True)
        out[f"{spec.uid}.json"] = text + "\n"
    return out


def markdown() -> str:
    lines = []
    for make in DASHBOARDS:
        spec = make()
        lines += [
            f"### {spec.title} (`dashboards/{spec.uid}.json`)",
            "",
            spec.description,
            "",
            "| panel | shows |",
            "|---|---|",
        ]
        lines += [f"| {p.title} | {p.description} |" for p in spec.panels()]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a committed dashboard differs",
    )
    mode.add_argument(
        "--markdown", action="store_true", help="print the dashboards' panel list as Markdown"
    )
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output directory")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown())
        return 0
    rendered = render()
    if args.check:
        stale = [
            name
            for name, text in rendered.items()
            if not (args.out / name).exists() or (args.out / name).read_text() != text
        ]
        for name in stale:
            print(f"stale: {args.out / name} (run {Path(__file__).name})", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in rendered.items():
        (args.out / name).write_text(text)
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
