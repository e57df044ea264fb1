"""The benchmarker's Prometheus metrics (README lists them all)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Info

# `task` is the task's name (its TOML's `name`): a replica serves every task it is allowed, and
# GFLOPS of different kernels are not comparable.
RESULTS = Counter(
    "hpcrl_benchmarker_results_total", "Verdicts published, by task and status", ["task", "status"]
)
GFLOPS = Histogram(
    "hpcrl_benchmarker_gflops",
    "GFLOPS of successful candidates, by task, stage and opt level",
    ["task", "stage", "opt_level"],
    buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000),
)
STEP_SECONDS = Histogram(
    "hpcrl_benchmarker_step_seconds",
    "Duration of each pipeline step",
    ["step"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
)
INFLIGHT = Gauge("hpcrl_benchmarker_inflight", "Candidates being benchmarked now")
SANDBOX_KILLS = Counter(
    "hpcrl_benchmarker_sandbox_kills_total",
    "Sandboxed processes killed at their wall-clock limit",
    ["reason"],
)
HOST = Info("hpcrl_benchmarker_host", "The host this replica measures on")
LOCK_WAIT = Histogram(
    "hpcrl_benchmarker_timing_lock_wait_seconds",
    "Wait for the timing lock (the node's, or every lock of the replica's CPU set)",
    buckets=(0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
LOCK_TIMEOUTS = Counter(
    "hpcrl_benchmarker_timing_lock_timeouts_total",
    "Candidates handed back because the timing lock stayed held past timing_lock_timeout_s",
)
RETIMED = Counter(
    "hpcrl_benchmarker_retimed_total",
    "Timing attempts beyond the first: a measurement's runs varied more than max_timing_cv",
)
NOISY = Counter(
    "hpcrl_benchmarker_noisy_results_total",
    "Successful results whose steadiest timing attempt still varied more than max_timing_cv",
)
SANDBOX_START = Histogram(
    "hpcrl_benchmarker_sandbox_start_seconds",
    "From a harness run's go to its first mark (what is left of the sandbox's set-up, begun "
    "during the compile, and the exec): not charged to the kernel; seconds mean the node's "
    "cores are saturated",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
CLIENT_REQUESTS = Counter(
    "hpcrl_benchmarker_client_requests_total",
    "Outside trainers' reward requests taken (reward-requests), by client (the broker user "
    'where publishers are authenticated; past 100 clients, "other")',
    ["client"],
)
CLIENT_VERDICTS = Counter(
    "hpcrl_benchmarker_client_verdicts_total",
    "Verdicts sent to outside trainers' queues, by client and status",
    ["client", "status"],
)
CLIENT_LATENCY = Histogram(
    "hpcrl_benchmarker_client_latency_seconds",
    "From a reward request's creation (the client's clock) to its verdict, by client",
    ["client"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
