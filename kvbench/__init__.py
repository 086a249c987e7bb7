"""kvbench: measured KV-cache compression.

Captures real KV traces from open decoder-only models on public text, runs them through pluggable compressors
and reports the measured rate, distortion, latency and task regression next to the entropy bound.
"""

__version__ = "0.1.0"
