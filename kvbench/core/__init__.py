"""The core abstractions: KV sequences, the compressor interface, the codec that frames fitted state, token items, the prefix trie and cache, RoPE, checks and timers."""
