"""Batched row layouts: serial caches joined into one cache per layer, rows retired and
extracted back (docs/batched.md)."""
