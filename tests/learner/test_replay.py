"""The supervised replay term: its file, its choice of examples, and what it does to a real
tiny Qwen2 when GRPO itself has nothing to learn from."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from hpcrl_common.replay import REPLAY_FILE, replay_line
from hpcrl_learner.backends.torch import TorchTrainer
from hpcrl_learner.config import LearnerSettings
from hpcrl_learner.replay import ReplayError, load_replay, pick, read_examples, split_probe

from .conftest import BAD, GOOD, PROMPT, sequences_of


def write(path: Path, rows: list[tuple[list[int], list[int], int]]) -> Path:
    path.write_text("".join(replay_line(p, c, stage=s, mode="deepen") for p, c, s in rows))
    return path


def test_load_keeps_the_stages_asked_for_that_fit(tmp_path):
    path = write(
        tmp_path / "r.jsonl",
        [(PROMPT, GOOD, 4), (PROMPT, BAD, 1), (PROMPT * 10, GOOD, 5)],
    )
    kept = load_replay(path, vocab_size=100, min_stage=4, max_tokens=20)
    assert [(e.stage, e.completion_ids.tolist()) for e in kept] == [(4, GOOD)]
    assert len(load_replay(path, vocab_size=100, min_stage=1, max_tokens=100)) == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt_ids": [1], "completion_ids": [2]}\n', "not a replay example"),
        ("not json\n", "not a replay example"),
        ('{"prompt_ids": [], "completion_ids": [2], "stage": 1, "mode": "seed"}\n', "non-empty"),
        ('{"prompt_ids": [1], "completion_ids": [500], "stage": 1, "mode": "seed"}\n', "outside"),
        ('{"prompt_ids": [1], "completion_ids": [-1], "stage": 1, "mode": "seed"}\n', "outside"),
    ],
)
def test_a_bad_line_is_refused_with_its_place(tmp_path, text, message):
    path = tmp_path / "r.jsonl"
    path.write_text(replay_line(PROMPT, GOOD, stage=1, mode="seed") + text)
    with pytest.raises(ReplayError, match=message) as raised:
        load_replay(path, vocab_size=100, min_stage=1, max_tokens=100)
    assert f"{path}:2" in str(raised.value)


def test_a_missing_file_or_nothing_to_replay_is_refused(tmp_path):
    with pytest.raises(ReplayError, match="no replay file"):
        load_replay(tmp_path / "none.jsonl", vocab_size=100, min_stage=1, max_tokens=100)
    path = write(tmp_path / "r.jsonl", [(PROMPT, BAD, 2)])
    with pytest.raises(ReplayError, match="none of its 1 examples is of stage 3"):
        load_replay(path, vocab_size=100, min_stage=3, max_tokens=100)


def test_pick_is_distinct_and_the_same_for_the_same_update(tmp_path):
    rows = [(PROMPT, [10 + n, 2], 1) for n in range(20)]
    examples = load_replay(
        write(tmp_path / "r.jsonl", rows), vocab_size=100, min_stage=1, max_tokens=99
    )
    chosen = pick(examples, 8, step=3)
    assert len({id(e) for e in chosen}) == 8
    assert [id(e) for e in pick(examples, 8, step=3)] == [id(e) for e in chosen]
    assert [id(e) for e in pick(examples, 8, step=4)] != [id(e) for e in chosen]
    assert len(pick(examples, 50, step=0)) == 20


def test_replay_needs_the_torch_backend_and_defaults_to_the_policys_file(tmp_path):
    settings = LearnerSettings(model_path=tmp_path, replay_coef=0.1)
    assert settings.replay_file() == tmp_path / REPLAY_FILE
    with pytest.raises(ValidationError, match="torch backend"):
        LearnerSettings(model_path=tmp_path, replay_coef=0.1, backend="swift")


def logprob(trainer: TorchTrainer, ids: list[int]) -> float:
    return float(trainer.logprobs(sequences_of([ids]))[0].sum())


@pytest.mark.parametrize("coef", [0.0, 1.0])
def test_replay_pulls_the_policy_towards_its_examples(tiny_model, tmp_path, coef):
    """Groups whose rewards are all equal give GRPO no gradient: with replay the taught
    completion (stage 4; the stage-1 one is filtered out) gains probability and the replay
    NLL reported is its own; without replay nothing moves."""
    path = write(tmp_path / "r.jsonl", [(PROMPT, GOOD, 4), (PROMPT, BAD, 1)])
    settings = LearnerSettings(
        model_path=tiny_model,
        learning_rate=2e-3,
        replay_coef=coef,
        replay_path=path,
        replay_min_stage=4,
        replay_per_step=4,
    )
    trainer = TorchTrainer(settings, seed=1)
    good0 = logprob(trainer, GOOD)
    nll = []
    for _ in range(4):
        result = trainer.step(sequences_of([BAD, BAD]))  # advantage 0 each
        nll.append(result.replay_nll)
    good1 = logprob(trainer, GOOD)
    if coef == 0:
        assert all(math.isnan(x) for x in nll)
        assert good1 == pytest.approx(good0, abs=1e-6)
    else:
        assert good1 > good0 + 0.5, (good0, good1)
        assert nll[-1] < nll[0] and np.isclose(nll[0], -good0 / len(GOOD), rtol=1e-4)


def write_kinds(path: Path) -> Path:
    """Three examples of each of four (stage, mode) kinds, completions told apart by token."""
    kinds = [(1, "seed"), (2, "deepen"), (2, "improve"), (5, "deepen")]
    path.write_text(
        "".join(
            replay_line(PROMPT, [30 + 3 * k + n, 2], stage=stage, mode=mode)
            for k, (stage, mode) in enumerate(kinds)
            for n in range(3)
        )
    )
    return path


def test_the_probe_covers_every_kind_the_same_way_and_is_held_out(tmp_path):
    examples = read_examples(write_kinds(tmp_path / "r.jsonl"), vocab_size=100)
    probe, rest = split_probe(examples, 4, max_tokens=99)
    assert {(e.stage, e.mode) for e in probe} == {
        (1, "seed"),
        (2, "deepen"),
        (2, "improve"),
        (5, "deepen"),
    }
    again, _ = split_probe(examples, 4, max_tokens=99)
    assert [e.completion_ids.tolist() for e in again] == [e.completion_ids.tolist() for e in probe]
    held = {tuple(e.completion_ids.tolist()) for e in probe}
    assert len(rest) == 8 and not held & {tuple(e.completion_ids.tolist()) for e in rest}


def test_the_probe_takes_what_fits_and_at_most_half(tmp_path):
    path = write(tmp_path / "r.jsonl", [(PROMPT, GOOD, 1), (PROMPT, BAD, 2), (PROMPT * 9, GOOD, 3)])
    examples = read_examples(path, vocab_size=100)
    probe, rest = split_probe(examples, 6, max_tokens=20)  # the third is too long
    assert len(probe) == 1 and len(rest) == 2
    assert len(probe[0].prompt_ids) == len(PROMPT)
    assert split_probe(examples, 0, max_tokens=99) == ([], list(examples))
    probe, _ = split_probe(examples[:1], 6, max_tokens=99)
    assert probe == []  # one example: replay keeps it


@pytest.mark.parametrize("coef", [0.0, 1.0])
def test_taught_nll_is_the_probes_likelihood_and_replay_never_sees_it(tiny_model, tmp_path, coef):
    path = write_kinds(tmp_path / "r.jsonl")
    settings = LearnerSettings(
        model_path=tiny_model,
        learning_rate=2e-3,
        replay_coef=coef,
        replay_path=path,
        replay_min_stage=1,
        probe_examples=4,
    )
    trainer = TorchTrainer(settings, seed=1)
    assert len(trainer.probe) == 4
    held = {tuple(e.completion_ids.tolist()) for e in trainer.probe}
    assert not held & {tuple(e.completion_ids.tolist()) for e in trainer.replay}
    assert len(trainer.replay) == (8 if coef else 0)
    tokens = sum(len(e.completion_ids) for e in trainer.probe)
    expected = -sum(logprob(trainer, e.completion_ids.tolist()) for e in trainer.probe) / tokens
    result = trainer.step(sequences_of([BAD, BAD]))
    after = -sum(logprob(trainer, e.completion_ids.tolist()) for e in trainer.probe) / tokens
    assert math.isfinite(result.taught_nll) and result.taught_nll == pytest.approx(after, rel=1e-4)
    if coef == 0:  # no gradient at all: the probe's likelihood does not move
        assert result.taught_nll == pytest.approx(expected, rel=1e-5)


def test_taught_nll_is_off_without_a_probe_or_a_file(tiny_model, tmp_path):
    path = write_kinds(tmp_path / "r.jsonl")
    off = TorchTrainer(
        LearnerSettings(model_path=tiny_model, replay_path=path, probe_examples=0), seed=1
    )
    no_file = TorchTrainer(
        LearnerSettings(model_path=tiny_model, replay_path=tmp_path / "none.jsonl"), seed=1
    )
    for trainer in (off, no_file):
        assert trainer.probe == []
        assert math.isnan(trainer.step(sequences_of([BAD, BAD])).taught_nll)
