"""The `swift` backend: status and the checks that run before it would start.

Status: NOT IMPLEMENTED in this build; `backend = "swift"` refuses to start and says why.
What we found in ms-swift 4.6.0 (the wheel read line by line; see services/learner/README.md):

* its GRPO trainers generate completions themselves; externally generated ones can only be
  injected by overriding private methods, which ties us to one ms-swift release;
* the Ray/Megatron worker ``swift.ray.megatron.megatron_worker.MegatronWorker`` exposes
  ``compute_logps``, ``train_step`` and ``update_weights`` on already-collated micro-batches
  (``collate_to_grpo_micro_batch`` -> ``(model_inputs, GRPOBatch)``), which is the route a
  driver pulling our rollout batches would take: it can be fed our exact token ids;
* it needs Megatron-Core, Ray and CUDA GPUs; it imports ``msgspec`` without declaring it;
* it pins ``transformers<5.20`` and ``peft<0.21``: it cannot share an environment with a
  newer transformers, so it is installed into its own environment on the GPU nodes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hpcrl_learner.config import LearnerSettings

REQUIRED_MODULES = {
    "swift": "ms-swift (pip install './services/learner[swift]')",
    "msgspec": "msgspec (imported by ms-swift, not declared by it)",
    "megatron.core": "Megatron-Core",
    "ray": "Ray",
}


class SwiftUnavailable(ImportError):
    pass


def missing_requirements() -> list[str]:
    """What this host lacks for the swift backend (empty when everything is there)."""
    missing = []
    for module, what in REQUIRED_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(what)
    try:
        import torch

        if not torch.cuda.is_available():
            missing.append("a CUDA GPU")
    except ImportError:
        missing.append("torch")
    return missing


def swift_backend(settings: LearnerSettings, resume_from: Path | None,
                  optimizer_dir: Path | None, seed: int) -> object:
    missing = missing_requirements()
    needs = f"; this host also lacks: {', '.join(missing)}" if missing else ""
    raise SwiftUnavailable(
        "learner.backend = 'swift' is not implemented in this build (the Megatron driver "
        "for ms-swift 4.6.0 is documented in services/learner/README.md but not built); "
        f"use backend = 'torch'{needs}"
    )
