"""Cross-session prefix dedup: the trie compressor and the pipeline that puts a coder under it."""
