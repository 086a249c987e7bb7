"""A compressed KV cache the model decodes with: stored segments, per-layer reads, eviction masks."""
