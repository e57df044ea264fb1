"""Prometheus metrics of the learner (names hpcrl_learner_*; the README lists them)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LOSS = Gauge("hpcrl_learner_loss", "GRPO loss of the last step")
KL = Gauge(
    "hpcrl_learner_kl",
    "k3 KL(policy || reference = version 0) per completion token, last step (NaN if beta = 0: "
    "no reference is loaded)",
)
ENTROPY = Gauge(
    "hpcrl_learner_entropy",
    "Policy entropy per completion token (nats, at logprob_temperature), last step",
)
ZERO_VARIANCE_GROUPS = Gauge(
    "hpcrl_learner_zero_variance_group_fraction",
    "Share of the last step's groups whose rewards are all equal (advantage 0: no preference)",
)
CLIP_FRACTION = Gauge("hpcrl_learner_clip_fraction", "Fraction of used tokens clipped, last step")
MASKED_FRACTION = Gauge(
    "hpcrl_learner_masked_token_fraction",
    "Fraction of completion tokens masked for |log(pi_theta/pi_sampling)| > max_log_ratio",
)
SAMPLER_KL = Gauge(
    "hpcrl_learner_sampler_kl", "k3 KL(sampling policy || trainer) per token, last step"
)
SAMPLER_KL_FRESH = Gauge(
    "hpcrl_learner_sampler_kl_fresh",
    "k3 KL(sampling policy || trainer) per token over the last step's samples drawn from the "
    "trainer's current weights (NaN if none): about 0 unless the sampler uses stale weights",
)
REPLAY_NLL = Gauge(
    "hpcrl_learner_replay_nll",
    "Negative log-likelihood per completion token of the last step's replay examples (NaN: "
    "replay_coef 0); rising: the policy forgets what it was taught",
)
TAUGHT_NLL = Gauge(
    "hpcrl_learner_taught_nll",
    "Negative log-likelihood per completion token of the held-out taught examples "
    "(probe_examples) under the policy after the last step (NaN: off); rising: the policy "
    "drifts on prompts it did not write, which its KL on its own samples does not show",
)
GRAD_NORM = Gauge("hpcrl_learner_grad_norm", "Global gradient norm before clipping, last step")
LEARNING_RATE = Gauge("hpcrl_learner_learning_rate", "Learning rate of the last step")
REWARD_MEAN = Gauge("hpcrl_learner_reward_mean", "Mean reward over the groups of the last step")
REWARD_MAX = Gauge("hpcrl_learner_reward_max", "Max reward over the groups of the last step")
ADVANTAGE_STD = Gauge("hpcrl_learner_advantage_std", "Std of the advantages of the last step")
POLICY_VERSION = Gauge("hpcrl_learner_policy_version", "Latest committed policy version")
GROUPS_TRAINED = Gauge("hpcrl_learner_groups_trained", "Groups trained on since version 0")
PENDING_GROUPS = Gauge("hpcrl_learner_pending_groups", "Groups received, waiting for a step")
TOKENS_PER_SECOND = Gauge(
    "hpcrl_learner_tokens_per_second", "Completion tokens per second of the last step's training"
)
STEPS = Counter("hpcrl_learner_steps_total", "Optimizer steps committed by this process")
SKIPPED_STEPS = Counter(
    "hpcrl_learner_skipped_updates_total",
    "Steps not taken (non-finite gradient): no version, their groups handed back for retry",
)
STEP_SECONDS = Histogram(
    "hpcrl_learner_step_seconds",
    "Wall time of a step: train (with the passes run as its groups arrived), save, commit",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
)
STALENESS = Histogram(
    "hpcrl_learner_staleness",
    "Versions between the learner and the oldest sample of each consumed group",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
)
STALE_DROPPED = Counter(
    "hpcrl_learner_stale_groups_dropped_total", "Groups dropped as older than max_staleness"
)
REFUSED = Counter(
    "hpcrl_learner_refused_batches_total",
    "Batches that can never be trained on (dead-lettered with the reason), counted as dropped",
)
DUPLICATES = Counter(
    "hpcrl_learner_duplicate_batches_total", "Redelivered batches already trained on (acked)"
)
