"""Measurements: rate (from bitstream bit counts), distortion, task loss and the entropy bound."""
