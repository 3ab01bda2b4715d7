"""``mlxkv serve``: mlx-lm's OpenAI-compatible server on mlxkv caches (docs/serving.md)."""
