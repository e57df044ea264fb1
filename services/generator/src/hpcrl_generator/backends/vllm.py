"""The vLLM backend: the production sampler (GPU with tensor parallelism, or vLLM's CPU build).

Weights change in place (`reload_weights` through a worker extension), without restarting
the engine. A failed reload can leave the engine dead, so callers validate a checkpoint
first (:func:`hpcrl_generator.weights.validate`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from hpcrl_common.messages import SamplingParams
from hpcrl_generator.prompt import require_chat_template
from hpcrl_generator.sampling import GroupJob, Sample, WeightFormat, is_greedy

EXTENSION = "hpcrl_generator.backends.vllm_worker.ReloadExtension"


class VLLMSampler:
    backend = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "auto",
        max_model_len: int = 4096,
        max_num_seqs: int = 64,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        kv_cache_space_gib: int = 4,
        cpu_threads: int = 0,
        enforce_eager: bool = True,
        enable_lora: bool = False,
        max_lora_rank: int = 64,
        seed: int = 0,
    ) -> None:
        # Read by the CPU build only; a GPU build ignores them. Set before vLLM is imported.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_space_gib))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM

        self.model_path = Path(model_path)
        self.max_model_len = max_model_len
        self.enable_lora = enable_lora
        extra = {"max_lora_rank": max_lora_rank} if enable_lora else {}
        extra.update(_cpu_scheduling(max_num_seqs, max_model_len))
        # The engine's processes read their thread settings when they start, inside LLM().
        with _environment_while(cpu_thread_environment(cpu_threads)):
            self.llm = LLM(
                model=str(self.model_path),
                dtype=dtype,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                enable_lora=enable_lora,
                seed=seed,
                worker_extension_cls=EXTENSION,
                **extra,
            )
        self._tokenizer = self.llm.get_tokenizer()
        require_chat_template(self._tokenizer, str(self.model_path))
        self._lora = None
        self.version = 0

    @property
    def tokenizer(self):
        return self._tokenizer

    def generate(
        self, prompt_token_ids: list[int], n: int, sampling: SamplingParams
    ) -> list[Sample]:
        (samples,) = self.generate_groups([GroupJob(list(prompt_token_ids), n, sampling)])
        return samples

    def generate_groups(self, jobs: Sequence[GroupJob]) -> list[list[Sample]]:
        """All groups in one `generate` call: the engine schedules their sequences together
        (continuous batching), which on CPU is most of the throughput for a small policy."""
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(job.prompt_token_ids)} for job in jobs],
            [_vllm_params(job) for job in jobs],
            use_tqdm=False,
            lora_request=self._lora,
        )
        if len(outputs) != len(jobs):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(jobs)} groups")
        groups = []
        for job, output in zip(jobs, outputs, strict=True):
            samples = [_sample(completion) for completion in output.outputs]
            groups.append(samples * job.n if is_greedy(job.sampling) else samples)
        return groups

    def load_weights(self, path: Path, version: int, format: WeightFormat = "full") -> None:
        if format == "lora" and not self.enable_lora:
            raise ValueError("a LoRA policy version needs generator.enable_lora = true")
        self._require_idle()
        if format == "full":
            self.llm.collective_rpc("hpcrl_reload_weights", kwargs={"weights_path": str(path)})
            self._lora = None
        else:
            from vllm.lora.request import LoRARequest

            # vLLM caches adapters by id; versions are unique, so each is loaded once.
            self._lora = LoRARequest(f"policy-v{version}", version, str(path))
        self._forget_prefix_cache()
        self.version = version

    def _require_idle(self) -> None:
        # Weights changed under a running request would give it tokens from two versions.
        running = self.llm.llm_engine.get_num_unfinished_requests()
        if running:
            raise RuntimeError(f"refusing to change weights while {running} request(s) run")

    def _forget_prefix_cache(self) -> None:
        """Drop every cached KV block; call after the weights change, before publishing.

        Prefix-cache blocks are keyed by token ids (and LoRA name), never by weights, and
        every real prompt shares its first blocks (system prompt, task text) with earlier
        ones: without this, a new version would attend to keys and values computed by the
        old one, so its samples and log-probs would match neither version.
        """
        if self.llm.reset_prefix_cache():
            return
        # Blocks still held although nothing was running: preempt whatever holds them (it is
        # recomputed from the new weights) rather than keep serving stale blocks.
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    def weight_fingerprint(self) -> list[list[float]]:
        return self.llm.collective_rpc("hpcrl_weight_fingerprint")

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()


def cpu_thread_environment(cpu_threads: int) -> dict[str, str]:
    """The environment that gives vLLM's CPU engine ``cpu_threads`` unpinned threads (0: none
    needed, vLLM pins one thread to each core itself).

    vLLM's own binding suits a node the engine has to itself. On a node whose cores the
    learner and the benchmarker share, a pinned thread whose core is busy holds up every
    parallel region, and its partner spins at the barrier meanwhile: one thread the OS can
    move to whichever core is free decodes faster there (README, Measurements).
    """
    if cpu_threads < 0:
        raise ValueError(f"cpu_threads must be 0 or more, not {cpu_threads}")
    if cpu_threads == 0:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(cpu_threads)}


@contextmanager
def _environment_while(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in the environment for the duration, then whatever was there before: the
    setting is the configuration's (a shell's OMP_NUM_THREADS does not undo it), and a
    second engine in the same process starts from the process's own environment."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _cpu_scheduling(max_num_seqs: int, max_model_len: int) -> dict[str, int]:
    """On vLLM's CPU build: a step's token budget that holds every sequence's whole prompt.

    Several seeded groups in one call overflow the default budget, so the scheduler prefills
    a prompt in chunks and rewinds that request's torch generator after each partial chunk;
    CPU generators have no offset to rewind, and the engine dies ("CPU Generator does not use
    offset"). With room for max_num_seqs full contexts no prompt is ever split. GPU builds
    rewind their generators fine and keep vLLM's default budget.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"max_num_batched_tokens": max_num_seqs * max_model_len}


def _vllm_params(job: GroupJob):
    from vllm import SamplingParams as VLLMSamplingParams

    sampling = job.sampling
    return VLLMSamplingParams(
        n=1 if is_greedy(sampling) else job.n,  # vLLM refuses n > 1 with greedy sampling
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=sampling.seed,
        logprobs=0,  # the sampled token's log-prob, from the raw distribution
        skip_special_tokens=True,
    )


def _sample(completion) -> Sample:
    tokens = list(completion.token_ids)
    per_token = completion.logprobs or []
    if len(per_token) != len(tokens):
        raise RuntimeError(f"vLLM returned {len(per_token)} log-probs for {len(tokens)} tokens")
    return Sample(
        token_ids=tokens,
        logprobs=[float(per_token[i][t].logprob) for i, t in enumerate(tokens)],
        finish_reason=completion.finish_reason,
        text=completion.text,
    )
