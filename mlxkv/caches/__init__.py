"""Live caches a model calls: one module per family, masks, named reads, schemes,
compiled-decode slots. They know nothing of files or of batched rows."""
