"""Supervised replay beside GRPO: a few of the policy's own teaching examples per step.

GRPO on a small policy keeps what earns rewards early (correct, modest kernels of stages 1-3)
and forgets what it was taught but rarely samples: the catalogue's fast stage 4-6 kernels
(measured in Experiment 2: the trained runs' correct OpenMP kernels ran at a median of 13-14
GFLOPS against 30-38 without updates). Adding ``replay_coef`` x the mean negative
log-likelihood of a few taught (prompt, completion) pairs to each step's loss, as InstructGPT's
PPO-ptx mixes pretraining data into PPO, pulls the policy back towards what it was taught
where GRPO alone drifts away from it.

The examples are token ids (the policy's own tokenizer: no text is rendered here), one JSON
object per line (``hpcrl_common.replay``): ``{"prompt_ids": [...], "completion_ids": [...],
"stage": n, "mode": "..."}``.
The bootstrap writes ``replay.jsonl`` beside the policy it trains (its SFT examples, exactly as
encoded for it); for another base model, write the file from its own SFT data.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcrl_common.replay import REPLAY_FILE


class ReplayError(ValueError):
    """The replay file cannot be used (missing, malformed, or nothing left to replay)."""


@dataclass(frozen=True)
class ReplayExample:
    prompt_ids: np.ndarray  # int64
    completion_ids: np.ndarray  # int64
    stage: int
    mode: str


def _example(line: str, where: str, vocab_size: int) -> ReplayExample:
    try:
        row = json.loads(line)
        prompt = np.asarray(row["prompt_ids"], dtype=np.int64)
        completion = np.asarray(row["completion_ids"], dtype=np.int64)
        stage, mode = int(row["stage"]), str(row["mode"])
    except (ValueError, TypeError, KeyError) as exc:
        raise ReplayError(f"{where}: not a replay example ({exc!r})") from exc
    if prompt.ndim != 1 or completion.ndim != 1 or not len(prompt) or not len(completion):
        raise ReplayError(f"{where}: prompt_ids and completion_ids must be non-empty id lists")
    ids = np.concatenate([prompt, completion])
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ReplayError(f"{where}: token ids outside the policy's vocabulary ({vocab_size})")
    return ReplayExample(prompt, completion, stage, mode)


def load_replay(
    path: Path, *, vocab_size: int, min_stage: int, max_tokens: int
) -> list[ReplayExample]:
    """The file's examples of stage ``min_stage`` and above that fit in ``max_tokens``."""
    if not path.is_file():
        raise ReplayError(
            f"{path}: no replay file (learner.replay_coef > 0 needs one; the bootstrap writes "
            f"{REPLAY_FILE} beside its policy, or set learner.replay_path)"
        )
    examples = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                examples.append(_example(line, f"{path}:{number}", vocab_size))
    kept = [
        e
        for e in examples
        if e.stage >= min_stage and len(e.prompt_ids) + len(e.completion_ids) <= max_tokens
    ]
    if not kept:
        raise ReplayError(
            f"{path}: none of its {len(examples)} examples is of stage {min_stage} or above "
            f"and at most {max_tokens} tokens long"
        )
    return kept


def pick(examples: Sequence[ReplayExample], count: int, step: int) -> list[ReplayExample]:
    """``count`` distinct examples (all, if fewer) for update number ``step``: the same ones
    again after a restart resumes that step."""
    rng = random.Random(f"hpcrl-replay/{step}")
    return rng.sample(list(examples), min(count, len(examples)))
