"""Prometheus metrics of the generator (names hpcrl_generator_*)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TOKENS = Counter(
    "hpcrl_generator_tokens_total",
    "Completion tokens sampled (rate() of it is tokens/s)",
    ["backend"],
)
PROMPT_TOKENS = Counter(
    "hpcrl_generator_prompt_tokens_total", "Prompt tokens processed", ["backend"]
)
COMPLETIONS = Counter(
    "hpcrl_generator_completions_total",
    "Completions published as candidates, by why they ended",
    ["backend", "finish_reason"],
)
REQUESTS = Counter(
    "hpcrl_generator_requests_total",
    "Generate requests, by outcome (done, rejected, version_timeout, failed)",
    ["outcome"],
)
REQUEST_SECONDS = Histogram(
    "hpcrl_generator_request_seconds",
    "Time of the engine call that sampled a request's G completions, with the other groups "
    "batched with it (excludes waiting for a version or the engine)",
    ["backend"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
BATCH_GROUPS = Histogram(
    "hpcrl_generator_batch_groups",
    "Requests (groups) sampled together in one engine call",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
POLICY_VERSION = Gauge("hpcrl_generator_policy_version", "Policy version loaded in the engine")
RELOADS = Counter(
    "hpcrl_generator_reloads_total",
    "Policy versions offered for loading, by outcome (loaded, refused, failed)",
    ["outcome"],
)
RELOAD_SECONDS = Histogram(
    "hpcrl_generator_reload_seconds",
    "Time to validate (checksum, shapes) and load one policy version",
    ["phase"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
ANNOUNCEMENTS_REFUSED = Counter(
    "hpcrl_generator_announcements_refused_total",
    "Weight announcements refused before loading, by reason (no_store, other_run, "
    "not_in_store, mismatch: forged, replayed or from another run)",
    ["reason"],
)
VERSION_WAITS = Counter(
    "hpcrl_generator_version_waits_total",
    "Requests that had to wait because their policy-version floor was above the loaded one",
)
VERSION_WAIT_SECONDS = Histogram(
    "hpcrl_generator_version_wait_seconds",
    "Time requests waited for their policy-version floor",
    buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600),
)
