"""The locally trained tokenizer: lossless, compact on kernels, Qwen-style chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, Qwen2Config

from hpcrl_bootstrap.build import host_isa
from hpcrl_bootstrap.chat import format_chat
from hpcrl_bootstrap.examples import chat_texts, make_examples
from hpcrl_bootstrap.tokenizer import train_tokenizer
from hpcrl_bootstrap.train import encode_examples
from hpcrl_common.task import load_task


@pytest.fixture(scope="module")
def trained(small_pairs):
    examples = make_examples(
        seed=0, count=300, task=load_task("matmul"), pairs=small_pairs, isa=host_isa()
    )
    return train_tokenizer(chat_texts(examples[:250]), vocab_size=2048), examples[250:]


def test_round_trip_is_lossless_even_for_unseen_text(trained) -> None:
    tokenizer, held_out = trained
    unseen = "kernel.c:3:5: error: \u2018kk\u2019 undeclared \u2014 \u00fcn\u00efcode\t\n\n x"
    texts = [held_out[0].completion, unseen, "", "    \n\t{}\n"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_kernels_take_fewer_tokens_than_characters(trained) -> None:
    tokenizer, held_out = trained
    completion = held_out[1].completion
    assert len(tokenizer(completion)["input_ids"]) < len(completion) / 2


def test_a_qwen2_model_directory_loads_the_same_tokenizer(trained, tmp_path) -> None:
    """transformers 5 rebuilds the tokenizer of a qwen2 directory as Qwen2Tokenizer: the ids
    must not change (the generator encodes prompts that way)."""
    tokenizer, held_out = trained
    tokenizer.save_pretrained(tmp_path)
    Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    ).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for ex in held_out[:10]:
        text = format_chat([m.model_dump() for m in ex.prompt]) + ex.completion
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_chat_template_is_qwen_style_and_special_tokens_are_set(trained, tmp_path) -> None:
    tokenizer, held_out = trained
    messages = [m.model_dump() for m in held_out[0].prompt]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == format_chat(messages)
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert plain == format_chat(messages, add_generation_prompt=False)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    for special in ("<|im_start|>", "<|im_end|>"):
        assert len(tokenizer(special, add_special_tokens=False)["input_ids"]) == 1
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(rendered)["input_ids"] == tokenizer(rendered)["input_ids"]
    assert (
        loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    )
    assert loaded.eos_token_id == tokenizer.eos_token_id


def test_examples_over_the_length_are_left_out_by_index(trained) -> None:
    tokenizer, held_out = trained
    full, none_out = encode_examples(held_out, tokenizer, 100_000)
    lengths = [len(e.input_ids) for e in full]
    assert not none_out and len(full) == len(held_out)
    cut = sorted(lengths)[len(lengths) // 2]
    kept, too_long = encode_examples(held_out, tokenizer, cut)
    assert too_long == [i for i, n in enumerate(lengths) if n > cut]
    assert len(kept) + len(too_long) == len(held_out) and too_long


def test_the_answer_opening_token_never_ends_a_turn(trained) -> None:
    """The token an answer opens with is never the last before the end of a turn, in answers
    or in prompts, so the policy cannot learn "an opening fence may end the answer". Answers
    that closed on a bare ```, the opening token, left a build that ended its stage 4-6
    answers right after opening them."""
    tokenizer, held_out = trained
    encoded, _ = encode_examples(held_out, tokenizer, 100_000)
    eos = tokenizer.eos_token_id
    openers = {e.input_ids[e.prompt_len] for e in encoded}
    before_eos = {
        ids[n - 1] for ids in (e.input_ids for e in encoded) for n, t in enumerate(ids) if t == eos
    }
    assert openers and before_eos
    assert not openers & before_eos, [tokenizer.decode([t]) for t in openers & before_eos]
