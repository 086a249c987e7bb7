"""Rows by model, and the note naming the trace each model's rows were measured on, shared by the study sections."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from kvbench.report.collect import numeric


def trace_note(d: pd.DataFrame) -> str:
    """The trace every row was measured on, when they share one: model, windows, cache dtype, the bound."""
    need = {"model", "dataset", "n_sequences", "n_tokens", "bound_bits_per_token"}
    if d.empty or not need <= set(d.columns) or d[["model", "dataset", "n_sequences"]].nunique().max() > 1:
        return ""
    r = d.iloc[0]
    t = int(r["n_tokens"]) // int(r["n_sequences"])
    dtype = f", {r['dtype']} cache" if "dtype" in d else ""
    return (f"Trace: {r['model']} / {r['dataset']}, {int(r['n_sequences'])} sequences x {t} tokens{dtype}; bound "
            f"H(token | history) = {numeric(d, 'bound_bits_per_token').mean():.3f} bits/token. Times are per {t}-token "
            "sequence.")


def by_model(d: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    return [(str(m), g) for m, g in d.groupby("model", sort=False)] if "model" in d and not d.empty else []


def model_first(d: pd.DataFrame, *then: str, models: Sequence[str] = ()) -> pd.DataFrame:
    """The rows grouped by model (``models`` first, then the others in the order they first appear), then by
    ``then``; stable otherwise."""
    if d.empty or "model" not in d:
        return d
    order = {m: i for i, m in enumerate(dict.fromkeys([*models, *d["model"]]))}
    keys = d.assign(_m=d["model"].map(order), **{f"_{c}": numeric(d, c) for c in then})
    return keys.sort_values(["_m", *(f"_{c}" for c in then)], kind="stable").drop(
        columns=["_m", *(f"_{c}" for c in then)])


def trace_notes(d: pd.DataFrame) -> str:
    """The trace note of each model's rows."""
    return " ".join(n for _, g in by_model(d) if (n := trace_note(g)))
