"""hpcrl generator.

Samples completions with vLLM or transformers and hot-loads new policy weights."""
