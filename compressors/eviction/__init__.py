"""Token eviction: which tokens a cache keeps (SnapKV, TOVA, H2O, KNorm, StreamingLLM, expected attention, random)."""
