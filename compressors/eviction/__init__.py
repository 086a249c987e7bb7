"""Token eviction: which tokens a cache keeps (SnapKV, TOVA, H2O, KNorm, StreamingLLM, expected attention, KVzip,
random), and budget rules over any of their scores (AdaKV, PyramidKV)."""
