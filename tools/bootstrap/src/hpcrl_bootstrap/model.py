"""The Qwen2 models the project builds: the embedded policy and small random ones.

Every Qwen2 the project makes comes from :func:`build_model`: ``train`` trains the policy from
it, and tests and benchmarks write small random models with :func:`write_random_model`
(tokenizer: :func:`tiny_tokenizer`, the policy's own pipeline and chat template trained on a
few lines), so what they exercise is the policy's architecture, tokenizer and chat format.

    python -m hpcrl_bootstrap.model OUT [--hidden-size 128] [--layers 2] [--heads 2] [--seed 0]

writes a tiny random model for smoke runs (e.g. ``hpcrl-generator sample``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl_bootstrap.chat import END_OF_TEXT

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM


@dataclass(frozen=True)
class ModelShape:
    """The Qwen2 shape; the policy's defaults live in build.BootstrapSettings (the cache key)."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    max_positions: int


def tiny_shape(
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int | None = None,
    max_positions: int = 1024,
) -> ModelShape:
    """A small shape: MLP twice the hidden size, as many KV heads as heads unless given."""
    return ModelShape(
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        kv_heads=heads if kv_heads is None else kv_heads,
        intermediate_size=hidden_size * 2,
        max_positions=max_positions,
    )


TINY = tiny_shape()

# What tiny tokenizers are trained on: enough kernel-like text that prompts and kernels take
# multi-character tokens, and quick to train.
TINY_CORPUS = (
    "void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {",
    "  for (int i = 0; i < M; i++)",
    "    for (int j = 0; j < N; j++) {",
    "      double sum = 0.0;",
    "      for (int k = 0; k < K; k++) sum += A[i * K + k] * B[k * N + j];",
    "      C[i * N + j] = sum;",
    "    }",
    "}",
    "#include <immintrin.h>",
    "#pragma omp parallel for",
    "__m512d a = _mm512_loadu_pd(&A[i * K + k]);",
    "Write a faster matrix multiplication kernel in C. Use register blocking.",
    "You are an expert HPC programmer. Improve the program below.",
)


def qwen2_config(
    shape: ModelShape,
    tokenizer: PreTrainedTokenizerFast,
    *,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = True,
) -> Qwen2Config:
    """``vocab_size`` may exceed the tokenizer (unused rows, as Qwen2's own checkpoints have);
    by default it is the tokenizer's size."""
    from transformers import Qwen2Config

    rows = len(tokenizer) if vocab_size is None else vocab_size
    if rows < len(tokenizer):
        raise ValueError(f"vocab_size {rows} is smaller than the tokenizer ({len(tokenizer)})")
    return Qwen2Config(
        vocab_size=rows,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,
        bos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


def build_model(
    shape: ModelShape,
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    *,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = True,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM (Qwen2's own initialisation, seeded)."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(
        qwen2_config(
            shape, tokenizer, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings
        )
    )


def tiny_tokenizer(
    texts: Sequence[str] = TINY_CORPUS, vocab_size: int = 384
) -> PreTrainedTokenizerFast:
    """The policy's tokenizer pipeline and chat template, trained on ``texts``."""
    from hpcrl_bootstrap.tokenizer import train_tokenizer

    # Repeated so that every pair clears train_tokenizer's minimum frequency.
    return train_tokenizer(list(texts) * 4, vocab_size=vocab_size)


def write_random_model(
    out: str | Path,
    shape: ModelShape = TINY,
    *,
    seed: int = 0,
    init_std: float | None = 0.2,
    tie_word_embeddings: bool = True,
    vocab_size: int | None = None,
    with_tokenizer: bool = True,
) -> Path:
    """Write a randomly initialised model (and its tokenizer) to ``out`` and return ``out``.

    ``init_std``: every matrix drawn from N(0, init_std) instead of Qwen2's initialisation
    (``None`` keeps that). Qwen2's is nearly uniform over the vocabulary; 0.2 makes greedy
    outputs depend on the weights, so tests can tell one version from another.
    """
    import torch

    out = Path(out)
    tokenizer = tiny_tokenizer()
    model = build_model(
        shape, tokenizer, seed, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings
    )
    if init_std is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0.0, init_std)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if with_tokenizer:
        tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpcrl_bootstrap.model",
        description="Write a tiny randomly initialised Qwen2 model with the policy's tokenizer "
        "and chat template (tests, smoke runs; it writes noise).",
    )
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--hidden-size", type=int, default=TINY.hidden_size)
    parser.add_argument("--layers", type=int, default=TINY.layers)
    parser.add_argument("--heads", type=int, default=TINY.heads)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = tiny_shape(args.hidden_size, args.layers, args.heads)
    print(write_random_model(args.out, shape, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
