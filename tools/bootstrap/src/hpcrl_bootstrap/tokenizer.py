"""A byte-level BPE tokenizer trained locally on the corpus, with a Qwen-style chat template.

The pipeline (NFC, Qwen2's pre-tokenization pattern, byte-level BPE) is Qwen2's on purpose:
transformers 5 loads the tokenizer of any ``model_type: qwen2`` directory as
``Qwen2Tokenizer``, which rebuilds exactly this pipeline around the saved vocabulary and
merges. A tokenizer with any other pre-tokenization would encode differently there (and so in
the generator) than in training. Byte-level, so any text still encodes.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hpcrl_bootstrap.chat import (
    CHAT_TEMPLATE,
    END_OF_TEXT,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
)

# Qwen2's pre-tokenization pattern (the value transformers' Qwen2Tokenizer uses): required
# for the compatibility described above.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return wrap(core)


def wrap(core: Tokenizer) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
        model_max_length=2048,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def render_chat(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
) -> str:
    return str(
        tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    )
