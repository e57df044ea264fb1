"""The embedded policy bootstrap: a small code model the project builds itself.

A seeded corpus of matrix-multiply kernels (``corpus``), scheduler-style prompts for them
(``examples``), a locally trained tokenizer (``tokenizer``), a small Qwen2 model trained by
supervised fine-tuning on CPU (``train``), cached as an ordinary Hugging Face model directory
(``build``). ``python -m hpcrl_learner.bootstrap --help`` builds one.
"""

from hpcrl_learner.bootstrap.build import (
    BootstrapSettings,
    default_dir,
    ensure_model,
    is_ready,
)
from hpcrl_learner.bootstrap.corpus import Kernel, best_kernels

__all__ = ["BootstrapSettings", "Kernel", "best_kernels", "default_dir", "ensure_model",
           "is_ready"]
