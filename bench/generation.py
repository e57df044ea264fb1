"""Tokens/s of the generator's vLLM backend versus its transformers backend, in one run, and
of vLLM sampling every group in one engine call versus one group per call.

Both sample the same groups (G completions per prompt, same sampling settings) from the same
tiny local Qwen2 model (built here unless --model is given, e.g. the demo's policy). Sampling
at temperature 1 with fixed seeds; tokens/s counts the completion tokens actually produced.
The batched run is what the generator does with an iteration's requests
(generator.max_batch_groups).

    .venv/bin/python bench/generation.py [--group-size 8] [--prompts 4] [--max-tokens 64]
        [--model data/policy/bootstrap-<hash>/model]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from hpcrl_common.messages import ChatMessage, SamplingParams

PROMPTS = [
    "Write a faster matrix multiplication kernel in C. Use register blocking.",
    "Improve the program below with cache blocking.",
    "Fix the compile error in the kernel below.",
    "You are an expert HPC programmer. Write matmul_optimized.",
]


def measure(sampler, prompts: list[list[int]], group: int, max_tokens: int) -> tuple[int, float]:
    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i) for i in range(len(prompts))
    ]
    sampler.generate(prompts[0], group, params[0])  # warm-up (first-call allocations)
    started = time.perf_counter()
    tokens = 0
    for ids, p in zip(prompts, params, strict=True):
        tokens += sum(len(s.token_ids) for s in sampler.generate(ids, group, p))
    return tokens, time.perf_counter() - started


def measure_batched(
    sampler, prompts: list[list[int]], group: int, max_tokens: int
) -> tuple[int, float]:
    from hpcrl_generator.sampling import GroupJob

    jobs = [
        GroupJob(ids, group, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i))
        for i, ids in enumerate(prompts)
    ]
    started = time.perf_counter()
    groups = sampler.generate_groups(jobs)
    elapsed = time.perf_counter() - started
    return sum(len(s.token_ids) for samples in groups for s in samples), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: tiny)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from hpcrl_bootstrap.model import tiny_shape, write_random_model
    from hpcrl_generator.backends.transformers import TransformersSampler
    from hpcrl_generator.backends.vllm import VLLMSampler
    from hpcrl_generator.prompt import render_prompt

    model = args.model
    if model is None:
        model = write_random_model(
            Path(tempfile.mkdtemp(prefix="hpcrl-genbench-")) / "tiny",
            tiny_shape(args.hidden_size, args.layers, args.heads),
        )
    print(
        f"model {model}; G={args.group_size}, {args.prompts} prompts, "
        f"max_tokens={args.max_tokens}, {os.cpu_count()} CPUs"
    )

    hf = TransformersSampler(model, dtype="float32")
    texts = (PROMPTS * args.prompts)[: args.prompts]
    prompts = [render_prompt(hf.tokenizer, [ChatMessage(role="user", content=t)]) for t in texts]
    hf_tokens, hf_s = measure(hf, prompts, args.group_size, args.max_tokens)
    hf.close()
    print(f"transformers: {hf_tokens} tokens in {hf_s:.2f} s = {hf_tokens / hf_s:.1f} tokens/s")

    started = time.perf_counter()
    context = max(512, max(map(len, prompts)) + args.max_tokens)
    vllm = VLLMSampler(
        model,
        dtype="float32",
        max_model_len=context,
        max_num_seqs=max(8, args.group_size * args.prompts),
        kv_cache_space_gib=1,
    )
    print(f"vllm engine start: {time.perf_counter() - started:.1f} s")
    vl_tokens, vl_s = measure(vllm, prompts, args.group_size, args.max_tokens)
    print(
        f"vllm:         {vl_tokens} tokens in {vl_s:.2f} s = {vl_tokens / vl_s:.1f} tokens/s "
        "(one group per engine call)"
    )
    vb_tokens, vb_s = measure_batched(vllm, prompts, args.group_size, args.max_tokens)
    vllm.close()
    print(
        f"vllm batched: {vb_tokens} tokens in {vb_s:.2f} s = {vb_tokens / vb_s:.1f} tokens/s "
        f"({args.prompts} groups in one engine call)"
    )
    print(f"vllm/transformers tokens/s ratio: {(vl_tokens / vl_s) / (hf_tokens / hf_s):.2f}")
    print(
        f"vllm batched/one group per call tokens/s ratio: "
        f"{(vb_tokens / vb_s) / (vl_tokens / vl_s):.2f}"
    )


if __name__ == "__main__":
    main()
