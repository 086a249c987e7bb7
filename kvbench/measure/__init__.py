"""The measuring commands: one run's rate, distortion and NLL; task accuracy; latency; restore time to first token."""
