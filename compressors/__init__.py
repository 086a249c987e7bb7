"""Compressor implementations, one module per family. Selected by ``_target_`` in ``configs/compressor/``."""
