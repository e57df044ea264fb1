"""hpcrl learner.

GRPO updates on rollout batches, versioned checkpoints, weight announcements."""
