"""Token ids tied to the judged text: a completion is trained only if its token ids decode to
the text the benchmarker judged.

The generator sends both a completion's text (which the benchmarker compiles and times) and
its token ids (which the learner trains on); nothing but this check binds one to the other,
so without it a generator could have a correct kernel judged and the learner reinforce any
tokens at all. The benchmarker hashes the text it judged (``completion_sha256`` of the
result, carried into the rollout batch by the scheduler); here the ids are decoded with the
policy's tokenizer the way the samplers make their text (``skip_special_tokens``: vLLM's
``completion.text`` and the transformers backend both drop the trailing EOS and any other
special token) and hashed.

One tolerated difference: a completion cut by max_tokens inside a multi-byte character. A
streaming detokenizer (vLLM's) never emits the incomplete character, a full decode ends in
U+FFFD; the text without those trailing U+FFFD is accepted too. A hash is not the text, so
no other difference passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hpcrl_common.messages import RolloutBatch, text_sha256
from hpcrl_learner.batches import BadBatch

REPLACEMENT = "\ufffd"


class TextCheck:
    """Checks every sample of a batch against the hash of its judged text."""

    def __init__(self, model_path: Path, *, require: bool) -> None:
        self.model_path = model_path
        self.require = require
        self._tokenizer: Any = None

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        return self._tokenizer

    def check(self, batch: RolloutBatch) -> None:
        """Raise :class:`BadBatch` (the batch is dead-lettered) for the first sample whose
        token ids are not those of the text that was judged."""
        for sample in batch.samples:
            if sample.completion_sha256 is None:
                if self.require:
                    raise BadBatch(
                        f"{sample.candidate_id}: no completion_sha256 (the hash of the text the "
                        f"benchmarker judged), so its tokens cannot be tied to the verdict; "
                        f"learner.require_judged_text = false trains such samples (results of "
                        f"older benchmarkers, during a rolling upgrade)"
                    )
                continue
            ids = sample.completion_token_ids.numpy().astype(np.int64).tolist()
            try:
                text = self.tokenizer().decode(ids, skip_special_tokens=True)
            except Exception as exc:  # ids the tokenizer cannot map
                raise BadBatch(f"{sample.candidate_id}: token ids do not decode: {exc!r}") from None
            if matches(text, sample.completion_sha256):
                continue
            raise BadBatch(
                f"{sample.candidate_id}: its {len(ids)} token ids decode to a text (sha256 "
                f"{text_sha256(text)[:16]}…, {len(text)} characters) other than the one the "
                f"benchmarker judged (sha256 {sample.completion_sha256[:16]}…): the tokens "
                f"are not those of the judged completion"
            )


def matches(decoded: str, judged_sha256: str) -> bool:
    if text_sha256(decoded) == judged_sha256:
        return True
    trimmed = decoded.rstrip(REPLACEMENT)
    return trimmed != decoded and text_sha256(trimmed) == judged_sha256
