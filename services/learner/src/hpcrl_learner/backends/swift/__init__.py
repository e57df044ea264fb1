"""The `swift` backend: ms-swift 4.6.0's Megatron workers driven by our rollout batches.

Why this route (ms-swift 4.6.0, read line by line; see services/learner/README.md):

* its GRPO trainers generate completions themselves; externally generated ones could only be
  injected by overriding private methods, which ties us to one ms-swift release;
* its Ray/Megatron worker ``swift.ray.megatron.megatron_worker.MegatronWorker`` is driven by a
  driver process through public methods (``compute_logps``, ``compute_ref_logps``,
  ``train_step``) on micro-batches the driver collates with ``collate_to_grpo_micro_batch``.
  Our learner is that driver (modules of this package): ``convert`` builds the micro-batches
  from the exact sampled token ids (ms-swift's templates would rebuild prompts from messages),
  ``driver`` runs the step, ``worker`` adds a Hugging Face export into our checkpoint store,
  ``cluster`` starts the workers on Ray GPUs;
* it imports ``msgspec``, Ray and pyzmq without declaring them (our ``[swift]`` extra does) and
  pins ``transformers<5.20`` / ``peft<0.21``, so it lives in its own environment
  (``deploy/local/install-swift.sh``), plus Megatron-Core and CUDA on the GPU nodes.

Verified on CPU (tests/learner/test_swift_backend.py, in that environment): conversion, collation
by ms-swift's own code, and the driver's step end to end against a CPU worker group with a real
model. The GPU route (``cluster.start`` + the Megatron worker) has not run: no GPU was lent.

Importing this package needs none of ms-swift, and ``convert`` needs torch only (it imports
ms-swift inside the functions that call it); ``driver``, ``cluster`` and ``worker`` need the
ms-swift environment.
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


def swift_backend(
    settings: LearnerSettings, resume_from: Path | None, optimizer_dir: Path | None, seed: int
) -> object:
    missing = missing_requirements()
    if missing:
        raise SwiftUnavailable(
            "learner.backend = 'swift' cannot start on this host, which lacks: "
            f"{', '.join(missing)}. It runs in its own environment "
            "(deploy/local/install-swift.sh, plus Megatron-Core on CUDA GPUs); its GPU route "
            "is written but has never run on a GPU (see services/learner/README.md). "
            "Use backend = 'torch' here."
        )
    from hpcrl_learner.backends.swift.cluster import start

    return start(settings, resume_from, optimizer_dir)
