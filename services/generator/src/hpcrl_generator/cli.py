"""Command line of hpcrl-generator."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcrl_common.service import add_config_argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl-generator",
        description="Sample kernel completions from the current policy (vLLM or transformers) "
        "and hot-load new policy versions announced by the learner.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="consume generate-requests, publish G candidates each to code-to-bench, "
        "follow weight-updates",
        description="Run one generator replica: load the base model (generator.model_path), "
        "then the latest version in generator.checkpoint_dir if any; serve "
        "/metrics and /healthz on generator.metrics_port.",
    )
    add_config_argument(serve)

    sample = commands.add_parser(
        "sample",
        help="sample completions for one prompt and print them as JSON lines (no broker)",
        description="Start the configured backend, render PROMPT as one user message with "
        "the model's chat template, print one JSON object per completion.",
    )
    add_config_argument(sample)
    sample.add_argument("prompt", help="the user message")
    sample.add_argument("-n", type=int, default=1, help="completions (default 1)")
    sample.add_argument("--temperature", type=float, default=1.0)
    sample.add_argument("--top-p", type=float, default=1.0)
    sample.add_argument("--max-tokens", type=int, default=256)
    sample.add_argument("--seed", type=int, default=None)
    sample.add_argument(
        "--version-dir",
        type=Path,
        default=None,
        help="load this full checkpoint directory before sampling",
    )
    return parser


def serve(config_path: Path | None) -> int:
    from hpcrl_common.broker import Consumer
    from hpcrl_common.logs import configure_logging
    from hpcrl_common.service import apply_cpu_priority, load_or_exit, run_consumer
    from hpcrl_generator.backends import make_sampler
    from hpcrl_generator.config import GeneratorConfig
    from hpcrl_generator.service import Generator

    config = load_or_exit(GeneratorConfig, config_path)
    log = configure_logging("generator", config.logging.level, config.logging.format)
    section = config.generator
    apply_cpu_priority(section.cpu_priority)
    try:
        sampler = make_sampler(section)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: cannot start the {section.backend} backend: {exc}") from None
    consumer = Consumer(config.broker, "generator", concurrency=section.handler_threads)
    generator = Generator(sampler, section, consumer.topology)
    generator.start()
    generator.attach(consumer)
    log.info(
        "generator ready",
        backend=sampler.backend,
        model=str(section.model_path),
        policy_version=generator.tracker.loaded,
        replica=generator.replica,
    )
    try:
        run_consumer(consumer, "generator", section, generator.health)
    finally:
        sampler.close()
    return 0


def sample(args: argparse.Namespace) -> int:
    from hpcrl_common.messages import ChatMessage, SamplingParams
    from hpcrl_common.service import load_or_exit
    from hpcrl_generator.backends import make_sampler
    from hpcrl_generator.config import GeneratorConfig
    from hpcrl_generator.prompt import completion_budget, render_prompt

    section = load_or_exit(GeneratorConfig, args.config).generator
    sampler = make_sampler(section)
    try:
        if args.version_dir is not None:
            sampler.load_weights(args.version_dir, 1)
        ids = render_prompt(sampler.tokenizer, [ChatMessage(role="user", content=args.prompt)])
        budget = completion_budget(len(ids), args.max_tokens, sampler.max_model_len)
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=budget, seed=args.seed
        )
        for item in sampler.generate(ids, args.n, params):
            print(
                json.dumps(
                    {
                        "text": item.text,
                        "tokens": len(item.token_ids),
                        "finish_reason": item.finish_reason,
                        "logprob": round(sum(item.logprobs), 4),
                        "policy_version": sampler.version,
                    }
                )
            )
    finally:
        sampler.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args.config)
    if args.command == "sample":
        return sample(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
