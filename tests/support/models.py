"""Small random Qwen2 models for the test suites, built by hpcrl_bootstrap.model (no download).

``chat_model``: the generator's and evaluator's model (tied embeddings, weights drawn wide
enough that greedy outputs depend on them). ``learner_model``: the learner's (untied
embeddings, so a test can change the output layer alone; Qwen2's own initialisation).
"""

from __future__ import annotations

from pathlib import Path

from hpcrl_bootstrap.model import tiny_shape, write_random_model


def chat_model(out: Path, *, hidden_size: int = 128, heads: int = 2, seed: int = 0) -> Path:
    return write_random_model(out, tiny_shape(hidden_size, heads=heads), seed=seed)


def learner_model(out: Path, *, seed: int = 0) -> Path:
    return write_random_model(
        out,
        tiny_shape(64, heads=4, kv_heads=2, max_positions=4096),
        seed=seed,
        init_std=None,
        tie_word_embeddings=False,
    )


def perturbed_copy(src: Path, out: Path, *, scale: float = 0.2, seed: int = 1) -> Path:
    """Save ``src`` with Gaussian noise added to every matrix: a stand-in for a learner step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out
