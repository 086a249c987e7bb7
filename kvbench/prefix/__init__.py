"""Cross-session prefix sharing: an exact radix trie over token ids and prefix-cache policies replayed on it."""
