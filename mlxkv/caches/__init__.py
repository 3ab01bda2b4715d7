"""Live caches a model calls: one module per family, masks, named reads, schemes, compiled
decode steps. They know nothing of files or of batched layouts."""
