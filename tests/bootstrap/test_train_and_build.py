"""SFT pieces, and a tiny end-to-end bootstrap that loads back with transformers."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpcrl_bootstrap import cli
from hpcrl_bootstrap.build import (
    CORPUS_FILE,
    INFO_FILE,
    MARKER,
    BootstrapSettings,
    default_dir,
    ensure_model,
    is_ready,
)
from hpcrl_bootstrap.cli import build_parser, main, settings_from_args
from hpcrl_bootstrap.train import (
    IGNORE,
    Encoded,
    TrainSettings,
    batches,
    collate,
    completion_loss,
    lr_at,
)
from hpcrl_common.replay import REPLAY_FILE

TINY = BootstrapSettings(
    kernels_per_stage=(3, 3, 2, 1, 1, 1),
    examples=120,
    vocab_size=1024,
    hidden_size=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate_size=128,
    steps=3,
    batch_size=4,
    warmup_steps=1,
    precision="fp32",
)


def test_collate_trains_on_the_completion_only() -> None:
    batch = collate(
        [Encoded([5, 6, 7, 8, 9], prompt_len=3), Encoded([1, 2], prompt_len=1)],
        pad_id=0,
        multiple=4,
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [
        [IGNORE] * 3 + [8, 9] + [IGNORE] * 3,
        [IGNORE, 2] + [IGNORE] * 6,
    ]


def test_the_loss_is_the_full_cross_entropy_of_the_completion_tokens() -> None:
    """The output layer runs on the completion positions only: the loss and every gradient
    are those of the whole sequence's logits with the prompt's ignored."""
    from hpcrl_bootstrap.model import build_model, tiny_shape, tiny_tokenizer

    model = build_model(tiny_shape(hidden_size=32, heads=4, kv_heads=2), tiny_tokenizer(), 0)
    batch = collate(
        [Encoded(list(range(1, 41)), prompt_len=25), Encoded(list(range(50, 70)), prompt_len=3)],
        pad_id=0,
        multiple=8,
    )
    loss = completion_loss(model, batch)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = model(input_ids=batch["input_ids"]).logits
    full = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE,
    )
    assert loss.item() == pytest.approx(full.item(), rel=1e-6)
    theirs_all = torch.autograd.grad(full, list(model.parameters()))
    for mine, theirs in zip(grads, theirs_all, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


def test_batches_are_full_and_lr_warms_up_then_decays() -> None:
    encoded = [Encoded(list(range(n % 7 + 2)), 1) for n in range(50)]
    plan = batches(encoded, batch_size=8, seed=0, steps=20)
    assert len(plan) == 20 and all(len(b) == 8 for b in plan)
    settings = TrainSettings(steps=100, learning_rate=1e-3, warmup_steps=10)
    assert lr_at(0, settings) == pytest.approx(1e-4)
    assert lr_at(9, settings) == pytest.approx(1e-3)
    assert lr_at(99, settings) < lr_at(50, settings) < lr_at(10, settings)


def test_settings_name_the_cache_directory(tmp_path: Path) -> None:
    assert default_dir(tmp_path, TINY) == default_dir(tmp_path, TINY)
    assert default_dir(tmp_path, TINY).parent == tmp_path / "policy"
    other = BootstrapSettings(**{**TINY.__dict__, "steps": 4})
    assert default_dir(tmp_path, other) != default_dir(tmp_path, TINY)


@pytest.mark.slow
def test_tiny_bootstrap_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "model"
    (out).mkdir()  # a half-built directory (no marker) must not count as a model
    (out / "config.json").write_text("{}")
    assert not is_ready(out)
    assert ensure_model(TINY, out) == out
    assert is_ready(out)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        INFO_FILE,
        MARKER,
    ):
        assert (out / name).is_file(), name
    info = json.loads((out / INFO_FILE).read_text())
    assert info["training"]["steps"] == 3 and info["key"] == TINY.key()
    # Nothing left out without a word: every example is kept or counted.
    assert info["examples_kept"] + info["examples_left_out_too_long"] == TINY.examples
    by_kind = info["examples_left_out_too_long_by_mode_and_stage"]
    assert sum(by_kind.values()) == info["examples_left_out_too_long"]
    corpus = json.loads((out / CORPUS_FILE).read_text())
    timed = [row for row in corpus if row["status"] == "success"]
    assert timed and all(row["gflops"] > 0 for row in timed)
    assert info["catalogue"]["kernels"] == len(corpus)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    tokenizer = AutoTokenizer.from_pretrained(out)
    kernel = timed[-1]["source"]
    assert (
        tokenizer(kernel)["input_ids"]
        == Tokenizer.from_file(str(out / "tokenizer.json")).encode(kernel).ids
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Stage 1."}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(0)
    generated = model.generate(
        **ids, do_sample=True, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id
    )
    assert generated.shape[1] > ids["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(generated[0]), str)

    # The replay file: every trained example, as the ids of its rendered prompt and of its
    # completion with the end of turn.
    replay = [json.loads(line) for line in (out / REPLAY_FILE).read_text().splitlines()]
    assert len(replay) == info["examples_kept"]
    assert {row["stage"] for row in replay} <= set(range(1, 7)) and len(replay) > 1
    first = replay[0]
    assert tokenizer.decode(first["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert first["completion_ids"][-1] == tokenizer.eos_token_id
    assert "matmul_optimized" in tokenizer.decode(first["completion_ids"])
    written = (out / REPLAY_FILE).read_bytes()

    # Cached: a second call neither rebuilds nor touches the weights.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(TINY, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # A build from before the replay file gets the same one, drawn again from the cache.
    (out / REPLAY_FILE).unlink()
    assert ensure_model(TINY, out) == out
    assert (out / REPLAY_FILE).read_bytes() == written
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # The CLI finds it and prints the directory as its last line.
    capsys.readouterr()
    assert main(["--out", str(out), "--steps", "3"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)


@pytest.mark.slow
def test_one_policy_for_several_tasks(tmp_path: Path) -> None:
    """Catalogues per task, examples shared between the tasks, one model; corpus.json's
    rows and bootstrap.json's catalogue name their task."""
    settings = dataclasses.replace(
        TINY, tasks=("spmv", "gemv"), kernels_per_stage=(2, 1, 1, 1, 1, 1), examples=41, steps=2
    )
    out = ensure_model(settings, tmp_path / "model")
    info = json.loads((out / INFO_FILE).read_text())
    assert info["settings"]["tasks"] == ["gemv", "spmv"] and info["key"] == settings.key()
    assert info["examples_by_task"] == {"gemv": 21, "spmv": 20}
    assert set(info["catalogue"]) == {"gemv", "spmv"}
    assert all(info["catalogue"][t]["correct"] > 0 for t in ("gemv", "spmv"))
    assert len({info["catalogue"][t]["cache"] for t in ("gemv", "spmv")}) == 2  # one per task
    corpus = json.loads((out / CORPUS_FILE).read_text())
    assert {row["task"] for row in corpus} == {"gemv", "spmv"}
    sources = {row["task"]: row["source"] for row in corpus if row["status"] == "success"}
    assert "gemv_optimized(" in sources["gemv"] and "spmv_optimized(" in sources["spmv"]


def test_module_entry_point_has_truthful_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hpcrl_bootstrap", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert done.stdout.startswith("usage: hpcrl-bootstrap")
    for flag in ("--data-dir", "--out", "--steps", "--seed", "--force", "--evaluate", "--tasks"):
        assert flag in done.stdout
    assert "--isa {auto,avx2,avx512}" in done.stdout


def test_isa_names_the_fleet_the_policy_is_built_for() -> None:
    """--isa avx2 on any host builds (and hashes) what an AVX2 node builds with auto."""
    for isa in ("avx2", "avx512"):
        args = build_parser().parse_args(["--isa", isa])
        settings = settings_from_args(args, "matmul")
        assert settings.resolved().isa == isa
        assert settings.key() == BootstrapSettings(isa=isa).key()
    auto = settings_from_args(build_parser().parse_args([]), "matmul")
    assert auto.resolved().isa == cli.host_isa()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--isa", "sse2"])


def test_isa_avx512_on_a_host_without_it_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # Which ISA this host has cannot be chosen here: the host is said to be AVX2-only.
    monkeypatch.setattr(cli, "host_isa", lambda: "avx2")
    assert main(["--isa", "avx512", "--data-dir", str(tmp_path)]) == 2
    assert "--isa avx512 needs a host with AVX-512F" in capsys.readouterr().err
    assert not (tmp_path / "policy").exists()
