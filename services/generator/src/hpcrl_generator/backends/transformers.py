"""The transformers backend: plain `generate`, for tiny models and hosts without vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from hpcrl_common.messages import SamplingParams
from hpcrl_generator.prompt import require_chat_template
from hpcrl_generator.sampling import (
    GroupJob,
    Sample,
    WeightFormat,
    is_greedy,
    trim_completion,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def stop_token_ids(model, tokenizer) -> set[int]:
    """EOS ids of the generation config (chat models list several) and of the tokenizer."""
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under the raw distribution: ``logits`` (..., T, V), ``tokens`` (..., T)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class TransformersSampler:
    backend = "transformers"

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        max_model_len: int = 4096,
    ) -> None:
        from transformers import AutoTokenizer

        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.dtype = _DTYPES.get(dtype, "auto")
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        require_chat_template(self._tokenizer, str(self.model_path))
        self.model = self._load(self.model_path)
        self.max_model_len = max_model_len
        self.stop_ids = stop_token_ids(self.model, self._tokenizer)
        self.pad_id = (
            self._tokenizer.pad_token_id
            if self._tokenizer.pad_token_id is not None
            else min(self.stop_ids)
        )
        self.version = 0

    @property
    def tokenizer(self):
        return self._tokenizer

    def _load(self, path: Path):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        return model.to(self.device).eval()

    @torch.inference_mode()
    def generate(
        self, prompt_token_ids: list[int], n: int, sampling: SamplingParams
    ) -> list[Sample]:
        greedy = is_greedy(sampling)
        rows = 1 if greedy else n
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        inputs = torch.tensor([prompt_token_ids], dtype=torch.long, device=self.device)
        # Every knob is explicit, so a model's own generation_config (Qwen ships top_k,
        # repetition_penalty, ...) cannot change the distribution the request asked for.
        knobs = dict(temperature=sampling.temperature, top_p=sampling.top_p) if not greedy else {}
        out = self.model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=not greedy,
            top_k=0,
            repetition_penalty=1.0,
            max_new_tokens=sampling.max_tokens,
            min_new_tokens=0,
            num_return_sequences=rows,
            eos_token_id=sorted(self.stop_ids),
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
            **knobs,
        )
        completions = out.sequences[:, len(prompt_token_ids) :]
        logits = torch.stack(out.logits, dim=1)  # (rows, T, V), before any warper
        logprobs = sampled_logprobs(logits, completions)
        samples = []
        for row in range(rows):
            tokens = completions[row].tolist()
            length, reason = trim_completion(tokens, self.stop_ids, sampling.max_tokens)
            kept = tokens[:length]
            samples.append(
                Sample(
                    token_ids=kept,
                    logprobs=logprobs[row, :length].tolist(),
                    finish_reason=reason,
                    text=self._tokenizer.decode(kept, skip_special_tokens=True),
                )
            )
        return samples * n if greedy else samples

    def generate_groups(self, jobs: Sequence[GroupJob]) -> list[list[Sample]]:
        """One group after another: `generate` pads a batch to its longest prompt, and this
        backend serves tiny models where batching buys little."""
        return [self.generate(job.prompt_token_ids, job.n, job.sampling) for job in jobs]

    def load_weights(self, path: Path, version: int, format: WeightFormat = "full") -> None:
        if format == "full":
            model = self._load(path)
        else:
            from peft import PeftModel

            model = PeftModel.from_pretrained(self._load(self.model_path), path)
            model = model.merge_and_unload().eval()
        self.model = model
        self.version = version

    def close(self) -> None:
        self.model = None
