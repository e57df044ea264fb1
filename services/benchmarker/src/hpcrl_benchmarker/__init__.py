"""hpcrl benchmarker.

Extracts, checks, compiles, verifies and times generated kernels in a sandbox."""
