"""Which completion tokens the policy-gradient term credits. Pure: no I/O, no model.

A deepen or improve completion rewrites its parent: most of its lines are the parent's, copied.
GRPO gives every token of a completion its advantage, so a copied line is pushed up or down by
whatever the rest of the kernel earned; where a group's failures share a copied line more often
than its successes (the SIMD attempts, which fail most, all carry `#include <immintrin.h>`),
the push is systematic. One run drifted so (seed 2 with supervised replay over every stage,
bench/records/2026-12-05: SIMD code without its include in 44 of the fixed set's 192 samples,
against 9 at version 0), though the default on the same seed and node did not (5).
With ``learner.skip_copied_lines`` a token whose characters all lie on lines found
verbatim (stripped) in the prompt earns no advantage: the credit goes to the edit. The KL term
still covers every token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def prompt_lines(prompt: str) -> frozenset[str]:
    """The prompt's non-blank lines, stripped: what a completion may copy."""
    return frozenset(stripped for line in prompt.splitlines() if (stripped := line.strip()))


def credit_mask(token_texts: Sequence[str], copied: frozenset[str]) -> np.ndarray:
    """1.0 per completion token, 0.0 for one whose characters all lie on lines of the
    completion that are in ``copied`` (a line's newline counts with it). A token without text
    (end of sequence) keeps its credit."""
    text = "".join(token_texts)
    on_copied = np.zeros(len(text) + 1, dtype=bool)
    start = 0
    for line in text.split("\n"):
        end = start + len(line)
        stripped = line.strip()
        if stripped and stripped in copied:
            on_copied[start : end + 1] = True
        start = end + 1
    mask = np.ones(len(token_texts), dtype=np.float32)
    position = 0
    for index, token in enumerate(token_texts):
        size = len(token)
        if size and on_copied[position : position + size].all():
            mask[index] = 0.0
        position += size
    return mask
