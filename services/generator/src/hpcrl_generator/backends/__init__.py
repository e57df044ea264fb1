"""Sampler backends: vLLM (production) and plain transformers (tiny models, no vLLM)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcrl_generator.config import GeneratorSection
    from hpcrl_generator.sampling import Sampler


def make_sampler(section: GeneratorSection) -> Sampler:
    """Start the configured backend on the base model (version 0)."""
    if section.backend == "transformers":
        from hpcrl_generator.backends.transformers import TransformersSampler

        return TransformersSampler(
            section.model_path,
            dtype=section.dtype,
            device=section.device,
            max_model_len=section.max_model_len,
        )
    from hpcrl_generator.backends.vllm import VLLMSampler

    return VLLMSampler(
        section.model_path,
        dtype=section.dtype,
        max_model_len=section.max_model_len,
        max_num_seqs=section.max_num_seqs,
        tensor_parallel_size=section.tensor_parallel_size,
        gpu_memory_utilization=section.gpu_memory_utilization,
        kv_cache_space_gib=section.kv_cache_space_gib,
        cpu_threads=section.cpu_threads,
        enforce_eager=section.enforce_eager,
        enable_lora=section.enable_lora,
        max_lora_rank=section.max_lora_rank,
    )
