"""Predictive coders: delta coding of the next KV from a prediction, and a cheaper model as predictor (speculative)."""
