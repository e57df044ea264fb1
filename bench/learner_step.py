"""Throughput of one GRPO step against the bootstrap's SFT, on the demo's policy shape.

Variants, each in its own child process (so peak memory is its own), alternated over rounds,
the best run of each counting (the least disturbed on a shared machine). A run is a warm-up
step and ``--steps`` timed steps, each on a fresh batch (new lengths, as the service sees
them), the same batches for every variant:

- ``sft``: the bootstrap's own supervised training (``hpcrl_bootstrap.train.train``) over the
  step's sequences: batches of 8 by length, padded to a multiple of 64, completion loss,
  AdamW, clipping; bf16 autocast as ``--precision`` says.
- ``grpo``: the learner's ``TorchTrainer.step`` on the same sequences as one GRPO step
  (4 groups of 8 sharing a prompt, advantages, sampler log-probs, beta > 0 so the reference
  model is used), autocast as ``--precision`` says (``learner.autocast``).
- ``grpo-unshared`` (with ``--variants``): ``grpo`` with ``learner.share_prompt_forward``
  off, each completion's row running its group's prompt again (the learner before sharing).
- ``bare`` (with ``--variants``): a minimal hand-written fp32 GRPO loop, the learner's
  overhead yardstick.

Tokens/s counts prompt + completion tokens of the step's sequences (what the bootstrap's
progress counts), so GRPO/SFT is the ratio of their step times.

    .venv/bin/python bench/learner_step.py [--steps 2] [--rounds 2] [--precision auto] ...
    .venv/bin/python bench/learner_step.py --variants grpo --threads 2 --beside 2   # shared node

The last line printed is GRPO tokens/s / SFT tokens/s (target >= 0.5).
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def make_batch(args: argparse.Namespace, vocab: int, seed: int = 0) -> list[dict]:
    """``groups`` prompts of ~``prompt_len`` tokens, ``group_size`` completions each of
    ``completion_min``..``completion_max`` tokens, rewards drawn per group."""
    rng = np.random.default_rng(seed)
    batch = []
    for _ in range(args.groups):
        prompt = rng.integers(
            3, vocab, int(rng.integers(args.prompt_len * 9 // 10, args.prompt_len * 11 // 10 + 1))
        )
        rewards = rng.normal(size=args.group_size)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for i in range(args.group_size):
            length = int(rng.integers(args.completion_min, args.completion_max + 1))
            batch.append(
                {
                    "prompt": prompt,
                    "completion": rng.integers(3, vocab, length),
                    # about what a policy near uniform would have sampled them with
                    "logp": np.full(length, -np.log(vocab), np.float32)
                    + rng.normal(0, 0.05, length).astype(np.float32),
                    "adv": float(adv[i]),
                }
            )
    return batch


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resolve(device: str) -> torch.device:
    return torch.device(
        device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )


def timed(step, batches: list[list[dict]], device: torch.device) -> list[float]:
    """Seconds of a warm-up step on ``batches[0]``, then of one step on each of the others
    (fresh lengths each step, as the service sees them)."""
    times = []
    for batch in batches:
        _sync(device)
        start = time.perf_counter()
        step(batch)
        _sync(device)
        times.append(time.perf_counter() - start)
    return times[1:]


def run_grpo(
    args: argparse.Namespace, model: Path, batches: list[list[dict]], share: bool = True
) -> list[float]:
    from hpcrl_learner.backends.torch import TorchTrainer
    from hpcrl_learner.batches import TrainSequence
    from hpcrl_learner.config import LearnerSettings

    extra = {}
    if "autocast" in LearnerSettings.model_fields:
        extra["autocast"] = {"auto": "auto", "bf16": "bf16", "fp32": "off"}[args.precision]
    if args.micro_tokens and "micro_batch_tokens" in LearnerSettings.model_fields:
        extra["micro_batch_tokens"] = args.micro_tokens
    if "share_prompt_forward" in LearnerSettings.model_fields:
        extra["share_prompt_forward"] = share
    trainer = TorchTrainer(
        LearnerSettings(
            model_path=model,
            learning_rate=1e-6,
            beta=args.beta,
            micro_batch_size=args.micro_batch,
            device=args.device,
            dtype="float32",
            **extra,
        )
    )

    def step(batch: list[dict]) -> None:
        metrics = trainer.step(
            [TrainSequence(b["prompt"], b["completion"], b["logp"], b["adv"]) for b in batch]
        )
        if args.verbose:
            print(json.dumps(metrics.metrics()), file=sys.stderr)

    return timed(step, batches, trainer.device)


def run_sft(args: argparse.Namespace, model: Path, batches: list[list[dict]]) -> list[float]:
    from transformers import AutoModelForCausalLM

    from hpcrl_bootstrap.train import Encoded, TrainSettings, train

    device = resolve(args.device)
    net = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).to(device)
    settings = TrainSettings(
        steps=-(-len(batches[0]) // args.micro_batch),
        batch_size=args.micro_batch,
        learning_rate=1e-4,
        warmup_steps=1,
        max_tokens=1 << 20,
        bf16=bf16_wanted(args.precision, device),
    )

    def step(batch: list[dict]) -> None:
        encoded = [
            Encoded([*b["prompt"].tolist(), *b["completion"].tolist()], len(b["prompt"]))
            for b in batch
        ]
        train(net, encoded, settings, pad_id=0)

    return timed(step, batches, device)


def run_bare(args: argparse.Namespace, model: Path, batches: list[list[dict]]) -> list[float]:
    from transformers import AutoModelForCausalLM

    device = resolve(args.device)
    net = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-6)
    return timed(lambda batch: bare_step(args, net, optimizer, batch, device), batches, device)


def bare_step(
    args: argparse.Namespace,
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: list[dict],
    device: torch.device,
) -> None:
    ordered = sorted(batch, key=lambda b: len(b["prompt"]) + len(b["completion"]))
    micro = []
    for start in range(0, len(ordered), args.micro_batch):
        part = ordered[start : start + args.micro_batch]
        # right padding, mask over completion targets: the textbook layout
        length = max(len(b["prompt"]) + len(b["completion"]) for b in part)
        ids = torch.zeros(len(part), length, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros(len(part), length - 1)
        old = torch.zeros(len(part), length - 1)
        for row, b in enumerate(part):
            tokens = np.concatenate([b["prompt"], b["completion"]])
            ids[row, : len(tokens)] = torch.from_numpy(tokens)
            attn[row, : len(tokens)] = 1
            p, c = len(b["prompt"]), len(b["completion"])
            mask[row, p - 1 : p - 1 + c] = 1
            old[row, p - 1 : p - 1 + c] = torch.from_numpy(b["logp"])
        adv = torch.tensor([b["adv"] for b in part])
        micro.append(tuple(t.to(device) for t in (ids, attn, mask, old, adv)))
    total = sum(float(m[2].sum()) for m in micro)
    optimizer.zero_grad()
    for ids, attn, mask, old, adv in micro:
        logits = net(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
        logits = logits.float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        a = adv[:, None]
        obj = torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
        (-(obj * mask).sum() / total).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    optimizer.step()


def bf16_wanted(precision: str, device: torch.device) -> bool:
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return True
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def child(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The same batches for every variant: a warm-up step, then one fresh batch per step.
    batches = [make_batch(args, args.vocab, seed) for seed in range(args.steps + 1)]
    fn = {
        "grpo": run_grpo,
        "grpo-unshared": functools.partial(run_grpo, share=False),
        "sft": run_sft,
        "bare": run_bare,
    }[args.child]
    times = fn(args, Path(args.model), batches)
    tokens = sum(len(b["prompt"]) + len(b["completion"]) for batch in batches[1:] for b in batch)
    completion = sum(len(b["completion"]) for batch in batches[1:] for b in batch)
    device = resolve(args.device)
    print(
        json.dumps(
            {
                "tokens_per_s": tokens / sum(times),
                "completion_tokens_per_s": completion / sum(times),
                "step_s": float(np.mean(times)),
                "max_step_s": max(times),
                "peak_mb": peak_memory_mb(device),
                "device": str(device),
                "bf16": bf16_wanted(args.precision, device),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        default="sft,grpo",
        help="comma-separated, of sft, grpo, grpo-unshared, bare (the ratios "
        "need sft/bare/grpo-unshared)",
    )
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="alternate the variants this many times; the best run counts",
    )
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=700, help="+-10%% per group")
    parser.add_argument("--completion-min", type=int, default=300)
    parser.add_argument("--completion-max", type=int, default=900)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=8,
        help="sequences per pass (SFT's batch size, learner.micro_batch_size)",
    )
    parser.add_argument(
        "--micro-tokens",
        type=int,
        default=0,
        help="learner.micro_batch_tokens (0: the learner's default)",
    )
    parser.add_argument("--beta", type=float, default=0.02)
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="bf16 autocast for SFT and GRPO alike (auto: where the CPU has "
        "avx512_bf16/amx_bf16, and on CUDA)",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--mlp", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch's default); 1 is steadier when shared",
    )
    parser.add_argument(
        "--beside",
        type=int,
        default=0,
        metavar="THREADS",
        help="run every variant beside a busy process of this many torch threads (bursts of "
        "matmuls with short gaps, as a decoding generator on the same node; 0: alone)",
    )
    parser.add_argument("--verbose", action="store_true", help="GRPO step metrics to stderr")
    parser.add_argument("--busy", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--child", choices=["grpo", "grpo-unshared", "sft", "bare"], help=argparse.SUPPRESS
    )
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.busy:
        busy_loop(args.busy)
        return
    from hpcrl_bootstrap.model import ModelShape, tiny_tokenizer, write_random_model

    variants = args.variants.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        shape = ModelShape(
            hidden_size=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate_size=args.mlp,
            max_positions=4096,
        )
        # The policy's architecture (tied embeddings, Qwen2's initialisation) at its vocab.
        vocab = max(args.vocab, len(tiny_tokenizer()))
        model = write_random_model(
            Path(tmp) / "m", shape, vocab_size=vocab, init_std=None, with_tokenizer=False
        )
        results: dict[str, dict] = {}
        beside = (
            subprocess.Popen([sys.executable, __file__, "--busy", str(args.beside)])
            if args.beside
            else None
        )
        try:
            measure(args, variants, model, results)
        finally:
            if beside is not None:
                beside.kill()
                beside.wait()
    report(args, variants, results)


def busy_loop(threads: int) -> None:
    """What a generator decoding on the same cores looks like to the learner: short bursts of
    matrix products on every thread, brief gaps between them; until killed."""
    torch.set_num_threads(threads)
    a = torch.randn(384, 384)
    while True:
        for _ in range(20):
            a @ a
        time.sleep(0.002)


def measure(
    args: argparse.Namespace, variants: list[str], model: Path, results: dict[str, dict]
) -> None:
    """Every variant in its own process, alternated over the rounds; the best run counts."""
    for _ in range(args.rounds):
        for variant in variants:
            argv = [
                sys.executable,
                __file__,
                *sys.argv[1:],
                "--child",
                variant,
                "--model",
                str(model),
            ]
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{variant} failed:\n{done.stderr}")
            if args.verbose:
                print(done.stderr, file=sys.stderr)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            best = results.get(variant)
            if best is None or run["tokens_per_s"] > best["tokens_per_s"]:
                results[variant] = run
            results[variant]["peak_mb"] = max(run["peak_mb"], best["peak_mb"] if best else 0.0)


def report(args: argparse.Namespace, variants: list[str], results: dict[str, dict]) -> None:
    sequences = args.groups * args.group_size
    first = results[variants[0]]
    print(
        f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} KV), MLP {args.mlp}, vocab {args.vocab}; step: {sequences} "
        f"sequences ({args.groups} groups), prompt ~{args.prompt_len}, completion "
        f"{args.completion_min}-{args.completion_max} tokens, micro-batch {args.micro_batch}, "
        f"beta {args.beta}, device {first['device']}, bf16 autocast {first['bf16']} "
        f"(--precision {args.precision}), {args.threads or 'default'} CPU thread(s), "
        f"best of {args.rounds} runs of a warm-up and {args.steps} timed steps, "
        f"a fresh batch each"
        + (f", beside a busy process of {args.beside} thread(s)" if args.beside else "")
    )
    for variant in variants:
        r = results[variant]
        print(
            f"{variant:13s} {r['tokens_per_s']:9.1f} tokens/s "
            f"({r['completion_tokens_per_s']:8.1f} completion)  {r['step_s']:7.2f} s/step "
            f"(slowest {r['max_step_s']:.2f})  "
            f"peak {r['peak_mb']:7.1f} MiB"
        )
    if "grpo" in results and "bare" in results:
        ratio = results["grpo"]["tokens_per_s"] / results["bare"]["tokens_per_s"]
        print(f"learner/bare tokens/s ratio: {ratio:.3f}")
    if "grpo" in results and "grpo-unshared" in results:
        ratio = results["grpo"]["tokens_per_s"] / results["grpo-unshared"]["tokens_per_s"]
        print(f"shared/unshared prompt tokens/s ratio: {ratio:.3f}")
    if "grpo" in results and "sft" in results:
        ratio = results["grpo"]["tokens_per_s"] / results["sft"]["tokens_per_s"]
        print(f"GRPO/SFT tokens/s ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
