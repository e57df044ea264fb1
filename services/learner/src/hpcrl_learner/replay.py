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

The same file gives the drift probe (``probe_examples``): a few examples of every stage and
mode, held out of replay, whose likelihood the trainer measures after each update. GRPO's KL
is taken on the policy's own samples, so it stays small while the policy forgets how to extend
parents it did not write; the probe's NLL rises then.
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


def read_examples(path: Path, *, vocab_size: int) -> list[ReplayExample]:
    """Every example of the file, in its order."""
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
    return examples


def load_replay(
    path: Path,
    *,
    vocab_size: int,
    min_stage: int,
    max_tokens: int,
    examples: Sequence[ReplayExample] | None = None,
) -> list[ReplayExample]:
    """The file's examples (or ``examples``, read from it already) of stage ``min_stage``
    and above that fit in ``max_tokens``."""
    if examples is None:
        examples = read_examples(path, vocab_size=vocab_size)
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


def split_probe(
    examples: Sequence[ReplayExample], count: int, *, max_tokens: int
) -> tuple[list[ReplayExample], list[ReplayExample]]:
    """(probe, rest): ``count`` examples that fit in ``max_tokens``, spread over every
    (stage, mode) in turn, and the others, which replay may use: the probe stays held out.
    It never takes more than half of what fits, so a small file still leaves replay some.

    The probe is the same for a given file whatever the step or restart, so a change in the
    policy's likelihood of it is the policy drifting, not a different sample."""
    fitting = [
        i for i, e in enumerate(examples) if len(e.prompt_ids) + len(e.completion_ids) <= max_tokens
    ]
    count = min(count, len(fitting) // 2)
    rng = random.Random("hpcrl-probe")
    rng.shuffle(fitting)
    kinds: dict[tuple[int, str], list[int]] = {}
    for i in fitting:
        kinds.setdefault((examples[i].stage, examples[i].mode), []).append(i)
    queues = [kinds[kind] for kind in sorted(kinds)]
    chosen: list[int] = []
    while len(chosen) < count and any(queues):
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    held = set(chosen)
    probe = [examples[i] for i in sorted(chosen)]
    return probe, [e for i, e in enumerate(examples) if i not in held]
