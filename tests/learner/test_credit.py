"""Credit to the edit (``learner.skip_copied_lines``): which completion tokens the policy
gradient credits, through the batch, the collation and the loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcrl_learner.batches import collate, prepare_group
from hpcrl_learner.credit import credit_mask, prompt_lines
from hpcrl_learner.grpo import LossSettings, grpo_loss

from .conftest import BAD, GOOD, _tokenizer, good_bad_batch

PARENT = """Improve this kernel:
```c
#include <immintrin.h>
#include <omp.h>

void kernel(double *x, int n) {
    #pragma omp parallel for
    for (int i = 0; i < n; i++) x[i] *= 2.0;
}
```"""
CHILD = """```c
#include <immintrin.h>
#include <omp.h>

void kernel(double *x, int n) {
    #pragma omp parallel for simd
    for (int i = 0; i < n; i++) x[i] *= 2.0;
}
```"""


def test_tokens_on_copied_lines_earn_nothing_and_the_edit_does() -> None:
    tokens = ["#include", " <omp.h>\n", "    x", " += 1;\n", "}\n", ""]
    mask = credit_mask(tokens, prompt_lines("#include <omp.h>\n}\n"))
    # the include line and the brace are the parent's; the new statement is the edit; the
    # end-of-sequence token (no text) keeps its credit
    assert mask.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_a_token_reaching_into_a_new_line_keeps_its_credit() -> None:
    # "\n    y" ends a copied line and begins a new one
    tokens = ["a = 1;", "\n    y", " = 2;"]
    assert credit_mask(tokens, prompt_lines("a = 1;")).tolist() == [0.0, 1.0, 1.0]


def test_blank_lines_and_indentation_do_not_make_a_line_copied() -> None:
    tokens = ["    ", "b = 3;", "\n", "\n"]
    # "b = 3;" is new even though the prompt has blank and indented lines
    assert credit_mask(tokens, prompt_lines("\n    \n  a = 1;\n")).tolist() == [1.0] * 4
    assert prompt_lines("  a = 1;  \n\n") == frozenset({"a = 1;"})


def test_with_the_policys_tokenizer_only_the_changed_line_is_credited() -> None:
    tokenizer = _tokenizer()
    ids = tokenizer(CHILD, add_special_tokens=False)["input_ids"]
    texts = [tokenizer.decode([token], skip_special_tokens=True) for token in ids]
    assert "".join(texts) == CHILD  # one token's text after another is the completion
    mask = credit_mask(texts, prompt_lines(PARENT))
    credited = "".join(text for text, m in zip(texts, mask, strict=True) if m)
    # every credited character belongs to the edited pragma line (and the token boundaries
    # around it); the includes, the signature and the loop earn nothing
    assert "simd" in credited
    assert "immintrin" not in credited and "include" not in credited
    assert "for (int i" not in credited and "void kernel" not in credited
    assert 0 < mask.sum() < len(mask) / 2


def test_prepare_group_and_collate_carry_the_credit() -> None:
    batch = good_bad_batch("credit", {"good": [0.0] * len(GOOD), "bad": [0.0] * len(BAD)})

    def first_token_copied(prompt: np.ndarray, completions: list[np.ndarray]) -> list[np.ndarray]:
        assert len(prompt) > 0
        return [np.r_[0.0, np.ones(len(ids) - 1)] for ids in completions]

    group = prepare_group(
        batch, 0, adv_eps=1e-4, vocab_size=64, max_sequence_tokens=64, credit=first_token_copied
    )
    plain = prepare_group(batch, 0, adv_eps=1e-4, vocab_size=64, max_sequence_tokens=64)
    assert all(seq.credit is None for seq in plain.sequences)
    collated = collate(group.sequences)
    assert collated.credit.shape == collated.completion_mask.shape
    rows = len(group.sequences)
    assert collated.credit[:, 0].tolist() == [0.0] * rows
    # credit only where there is a completion token: the padding of the shorter row is 0
    assert torch.equal(collated.credit, collated.completion_mask * collated.credit)
    assert collated.credit.sum() == collated.completion_mask.sum() - rows
    assert torch.equal(collate(plain.sequences).credit, collated.completion_mask)


def test_uncredited_tokens_get_no_policy_gradient_but_keep_the_kl_term() -> None:
    torch.manual_seed(0)
    logp = torch.randn(2, 3).clamp(-3, -0.1).requires_grad_()
    sampling, ref = logp.detach() - 0.05, logp.detach() + 0.2
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    credit = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]])

    def gradient(settings: LossSettings, credit: torch.Tensor | None) -> torch.Tensor:
        logp.grad = None
        grpo_loss(logp, sampling, adv, mask, settings, ref_logp=ref, credit=credit).loss.backward()
        assert logp.grad is not None
        return logp.grad.clone()

    no_kl = LossSettings(beta=0.0)
    assert torch.equal(gradient(no_kl, torch.ones(2, 3)), gradient(no_kl, None))
    masked = gradient(no_kl, credit)
    assert masked[0, 0] == 0 and masked[1, 1] == 0
    assert torch.equal(masked[credit > 0], gradient(no_kl, None)[credit > 0])
    # with beta > 0 an uncredited token still feels the KL term (its gradient is the KL's)
    with_kl = LossSettings(beta=0.1)
    kl_only = gradient(with_kl, torch.zeros(2, 3))
    assert (kl_only != 0).all()
    assert torch.allclose(gradient(with_kl, credit)[credit == 0], kl_only[credit == 0])
    with pytest.raises(ValueError, match="credit must be"):
        grpo_loss(logp, sampling, adv, mask, no_kl, credit=torch.ones(2, 2))
