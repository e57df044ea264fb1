"""The embedded policy bootstrap: a small code model the project builds itself.

A seeded catalogue of matrix-multiply kernels (``corpus``) judged and timed by the
benchmarker's own pipeline on this host (``catalogue``), scheduler prompts for pairs made from
those measurements (``examples``), a locally trained tokenizer (``tokenizer``), a small Qwen2
model trained by supervised fine-tuning on CPU (``train``), cached as an ordinary Hugging Face
model directory (``build``). ``hpcrl-bootstrap --help`` builds one.
"""

from hpcrl_bootstrap.build import (
    BootstrapSettings,
    default_dir,
    ensure_model,
    is_ready,
)
from hpcrl_bootstrap.corpus import Kernel

__all__ = ["BootstrapSettings", "Kernel", "default_dir", "ensure_model", "is_ready"]
