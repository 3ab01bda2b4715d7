"""mlxkv's benchmarks: each a module run from the repository root with mlxkv installed
(``python -m benchmarks.serving``), each contender measured against its baseline side by side
in one run; ``common.py`` holds what they share. Results go to ``benchmarks/results/``."""
