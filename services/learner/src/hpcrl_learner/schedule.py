"""The learning-rate schedule: linear warm-up, then constant or a linear decay to a floor."""

from __future__ import annotations


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of ``learning_rate`` for update ``step`` (0-based).

    Warm-up: ``(step + 1) / (warmup_steps + 1)``. Then 1.0 when ``decay_steps`` is 0; else a
    line from 1.0 down to ``min_lr_ratio`` over the next ``decay_steps`` updates, and the floor
    after them. A run of known length (the demo's nine iterations take about 17 updates)
    decays over it, so its late updates move the policy less than its early ones did.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay_steps <= 0:
        return 1.0
    done = min(1.0, (step - warmup_steps) / decay_steps)
    return 1.0 - (1.0 - min_lr_ratio) * done
