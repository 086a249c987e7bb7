"""Per-vector and per-channel quantizers: KIVI, TurboQuant (with QJL), KVQuant, FP8, and the codebooks they share."""
