"""The generator's config section (`[generator]` in the experiment TOML)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from hpcrl_common.config import ServiceConfig, related_default
from hpcrl_common.service import ServiceSection


class GeneratorSection(ServiceSection):
    metrics_port: int = Field(9101, ge=0, le=65535, description="0 picks a free port")
    backend: Literal["vllm", "transformers"] = Field(
        "vllm", description="vllm: production engine; transformers: tiny models, no vLLM"
    )
    model_path: Path = Field(
        description="Hugging Face model directory of the base policy (version 0); required; "
        "its tokenizer must have a chat template"
    )
    checkpoint_dir: Path | None = Field(
        related_default("generator.checkpoint_dir"),
        description="root of the learner's checkpoint store (manifest.json): new versions "
        "are found only through its manifest; unset: the base model only, every "
        "announcement refused",
    )
    replica: str = Field(
        "",
        description="name of this replica (default: hostname-pid); names its "
        "weight-updates queue and the candidates' `generator` field",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights/activation dtype (auto: the model's own; CPU vLLM "
        "wants float32 or bfloat16)",
    )
    max_model_len: int = Field(
        related_default("generator.max_model_len"),
        ge=16,
        description="prompt + completion tokens, at most",
    )
    max_num_seqs: int = Field(
        64,
        ge=1,
        description="vLLM: sequences decoded together (at least G decodes a group in one pass)",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM: GPUs per engine")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="vLLM on GPU: share of GPU memory the engine may use"
    )
    kv_cache_space_gib: int = Field(
        4, ge=1, description="vLLM on CPU: KV cache size (sets VLLM_CPU_KVCACHE_SPACE)"
    )
    cpu_threads: int = Field(
        0,
        ge=0,
        description="vLLM on CPU: engine threads. 0: vLLM's own binding (a thread pinned to "
        "each core); N: N threads the OS places freely (VLLM_CPU_OMP_THREADS_BIND=nobind, "
        "OMP_NUM_THREADS=N), for a node whose cores other services share",
    )
    enforce_eager: bool = Field(
        True,
        description="vLLM: no CUDA graphs / torch.compile (fast start, slower "
        "decode; false on GPUs for faster decode)",
    )
    enable_lora: bool = Field(
        related_default("generator.enable_lora"),
        description="vLLM: accept LoRA-format policy versions (LoRARequest)",
    )
    max_lora_rank: int = Field(64, ge=1, description="vLLM: largest LoRA rank accepted")
    device: str = Field(
        "cpu", description="transformers backend: torch device (cpu, cuda, cuda:1, ...)"
    )
    verify_checksum: bool = Field(
        True,
        description="check a version directory's sha256 against the store's manifest "
        "(which must match the announcement) before loading",
    )
    poll_manifest: bool = Field(
        True,
        description="read the checkpoint manifest before every request, so a new "
        "version is picked up even if its announcement is still queued",
    )
    version_wait_s: float = Field(
        300.0,
        gt=0,
        description="how long a request waits for its policy-version floor "
        "before it is returned to the queue (retried)",
    )
    version_poll_s: float = Field(1.0, gt=0, description="manifest poll interval while waiting")
    max_batch_groups: int = Field(
        8,
        ge=1,
        le=256,
        description="requests (groups) sampled together in one engine "
        "call; vLLM decodes their sequences together (max_num_seqs bounds how many at once)",
    )
    batch_window_s: float = Field(
        0.05,
        ge=0,
        le=10,
        description="how long a free engine waits for more requests "
        "to join its call (an iteration's requests arrive milliseconds apart)",
    )
    concurrency: int = Field(
        2,
        ge=2,
        description="handler threads; at least max_batch_groups + 1 run (one per "
        "request in a call, one more takes weight announcements meanwhile)",
    )

    @property
    def handler_threads(self) -> int:
        return max(self.concurrency, self.max_batch_groups + 1)


class GeneratorConfig(ServiceConfig):
    generator: GeneratorSection
