"""hpcrl-evaluate: a fixed evaluation set, judged by the real benchmarker, to tell whether
training helped (version 0 against a later policy version, same sampling seeds)."""
