"""Prometheus metrics of the scheduler (names hpcrl_scheduler_*).

Metrics per stage carry the ``task`` too (its name: one value per task of the experiment,
four in the multi-task demo), since a stage's GFLOPS mean nothing across tasks.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REWARD_BUCKETS = (-100, -40, -30, -20, -10, 0, 10, 25, 50, 75, 100, 150, 200, 300, 500, 1000, 2000)
GFLOPS_BUCKETS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 400, 800, 1600, 3200)
LAG_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

RESULTS = Counter(
    "hpcrl_scheduler_results_total", "Benchmark results filed, by outcome status", ["status"]
)
RESULTS_IGNORED = Counter(
    "hpcrl_scheduler_results_ignored_total",
    "Results not filed: duplicate, late (group already closed); dead-lettered: "
    "above_peak (above the host class's peak), wrong_task (judged as another task than its "
    "group's), rollout_mismatch (token data or judged text "
    "not what the generator committed to for the candidate), no_commitment (none came "
    "within commitment_wait_s)",
    ["reason"],
)
UPDATES_IGNORED = Counter(
    "hpcrl_scheduler_weight_updates_ignored_total",
    "Weight announcements that set no floor: other_experiment, "
    "other_run (another training run), old (not newer); dead-lettered: "
    "no_store, not_in_store, mismatch (not the manifest's entry), "
    "too_far (above floor + max_version_jump), pacing (figures out of "
    "range)",
    ["reason"],
)
PACING_CLAMPED = Counter(
    "hpcrl_scheduler_pacing_clamped_total",
    "Weight announcements whose groups done (trained + dropped) exceeded the rollout batches "
    "this scheduler sent (forged batches, replayed dead letters): paced by the batches sent",
)
HELD_RESULTS = Counter(
    "hpcrl_scheduler_results_held_total",
    "Results that came before their candidate's commitment and were held for it",
)
COMMITMENTS = Counter(
    "hpcrl_scheduler_commitments_total",
    "Generators' candidate commitments: filed, filed_without_text (a candidate-commitment/1 "
    "of an older generator: hashes only), duplicate (filed already), late (group closed), "
    "refused (no such group or index: dead-lettered)",
    ["outcome"],
)
EXCLUDED = Counter(
    "hpcrl_scheduler_results_excluded_total",
    "Results left out of their group because of a minority host class",
)
NO_ROLLOUT = Counter(
    "hpcrl_scheduler_samples_without_rollout_total",
    "Filed results that carried no token data (not sent to the learner)",
)
CONFIRMATIONS = Counter(
    "hpcrl_scheduler_confirmations_total",
    "Second measurements of group winners, and of a success measured once above a "
    "confirmed winner (of the generator's committed text): requested; "
    "answered agreed, disagreed (the committed text yields another source than the one "
    "reported, or measures far below the claim: winner dropped, host suspect) or "
    "inconclusive (another host class); winners dropped timed_out (a runner-up's: it "
    "counts at the confirmed winner's figure) or unconfirmed (rounds "
    "spent); no_source (not re-measurable: dropped, or counted with confirm_without_source "
    "= count); no_text (no committed text: dropped); reported_source (no committed text, "
    "re-measured from the source it reports: require_committed_text = false)",
    ["outcome"],
)
SUSPECT_RESULTS = Counter(
    "hpcrl_scheduler_suspect_results_total",
    "Results marked suspect: a winner and the second measurement that disagreed with it",
)
GROUPS_CLOSED = Counter(
    "hpcrl_scheduler_groups_closed_total",
    "Groups closed, by reason (complete, deadline)",
    ["reason"],
)
BATCHES = Counter(
    "hpcrl_scheduler_batches_total",
    "Closed groups by what went to the learner (sent, no_rollout, empty, below_train_stage)",
    ["outcome"],
)
REQUESTS = Counter(
    "hpcrl_scheduler_requests_total", "Generation requests published, by mode", ["mode"]
)
GROUP_REWARD_MEAN = Histogram(
    "hpcrl_scheduler_group_reward_mean", "Mean reward of each closed group", buckets=REWARD_BUCKETS
)
GROUP_REWARD_MAX = Histogram(
    "hpcrl_scheduler_group_reward_max", "Max reward of each closed group", buckets=REWARD_BUCKETS
)
GFLOPS = Histogram(
    "hpcrl_scheduler_gflops",
    "GFLOPS of each successful program, by task and stage",
    ["task", "stage"],
    buckets=GFLOPS_BUCKETS,
)
RESULT_LAG = Histogram(
    "hpcrl_scheduler_result_lag_seconds",
    "Time from a result's creation by the benchmarker to its filing",
    buckets=LAG_BUCKETS,
)
GROUP_SECONDS = Histogram(
    "hpcrl_scheduler_group_seconds",
    "Time from a request's publication to its group's closing",
    buckets=LAG_BUCKETS,
)

BEST_GFLOPS = Gauge(
    "hpcrl_scheduler_best_gflops",
    "Best GFLOPS of the programs of one task and stage in one iteration",
    ["task", "stage", "iteration"],
)
MEDIAN_GFLOPS = Gauge(
    "hpcrl_scheduler_median_gflops",
    "Median GFLOPS of the successful programs of one task and stage in one iteration",
    ["task", "stage", "iteration"],
)
BEST_GFLOPS_STAGE = Gauge(
    "hpcrl_scheduler_best_gflops_overall",
    "Best GFLOPS of a task and stage over the whole run",
    ["task", "stage"],
)
ITERATION_REWARD_MEAN = Gauge(
    "hpcrl_scheduler_iteration_reward_mean",
    "Mean reward over the closed groups' samples of one iteration",
    ["iteration"],
)
ITERATION_REWARD_MAX = Gauge(
    "hpcrl_scheduler_iteration_reward_max", "Max reward of one iteration", ["iteration"]
)
POOL = Gauge(
    "hpcrl_scheduler_pool_programs",
    "Programs (deduplicated) in the pool being built, by task, stage and status",
    ["task", "stage", "status"],
)
GROUPS = Gauge(
    "hpcrl_scheduler_groups",
    "Groups of the current iteration by state (pending, published = in flight, closed)",
    ["state"],
)
IN_FLIGHT = Gauge("hpcrl_scheduler_groups_in_flight", "Requests published, groups not closed")
OUTSTANDING = Gauge(
    "hpcrl_scheduler_groups_outstanding", "Groups published but not yet trained on (pacing)"
)
HELD = Gauge(
    "hpcrl_scheduler_requests_held",
    "Pending requests held back by pacing, by reason (in_flight, staleness)",
    ["reason"],
)
ITERATION = Gauge("hpcrl_scheduler_iteration", "Current SQD iteration (0-based)")
ITERATIONS = Gauge("hpcrl_scheduler_iterations", "T: iterations this run will do")
ITERATIONS_DONE = Gauge("hpcrl_scheduler_iterations_done", "Iterations completed")
POLICY_VERSION = Gauge("hpcrl_scheduler_policy_version", "Latest policy version announced")
GROUPS_TRAINED = Gauge(
    "hpcrl_scheduler_groups_trained",
    "Groups the learner reports done: trained, or dropped as stale",
)
SUSPECT_HOSTS = Gauge(
    "hpcrl_scheduler_suspect_hosts",
    "Benchmark hosts whose winners a second measurement contradicted (/healthz: suspect_hosts)",
)
RESULTS_HELD = Gauge(
    "hpcrl_scheduler_results_awaiting_commitment",
    "Results waiting for their candidate's commitment (not counted in their group yet)",
)
UNSENT = Gauge("hpcrl_scheduler_outbox_unsent", "Messages written but not yet confirmed")
