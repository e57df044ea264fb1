"""A tiny Qwen2 policy built from a config on the spot (tests, benches, smoke runs: no hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM


def build_tiny_model(
    path: Path,
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    with_tokenizer: bool = True,
) -> Path:
    """Write a randomly initialised Qwen2 causal LM (and a byte-level tokenizer) to ``path``."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Qwen2ForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    if with_tokenizer:
        _byte_tokenizer(vocab_size).save_pretrained(str(path))
    return path


def _byte_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {token: index for index, token in enumerate(specials)}
    for code in range(vocab_size - len(specials)):
        vocab.setdefault(chr(0x100 + code), len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")
