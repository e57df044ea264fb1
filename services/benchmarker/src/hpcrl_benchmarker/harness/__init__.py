"""Harness templates in C, one per task ``harness`` name (``gemm.c`` for ``harness = "gemm"``)."""
