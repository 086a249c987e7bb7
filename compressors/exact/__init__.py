"""Exact coders: the 16-bit identity, lossless entropy coding, and token recompute (the entropy bound's coder)."""
