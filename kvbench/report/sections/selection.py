"""Which runs a study section shows.

Each study section shows the cells of its presets in ``configs/experiment/``: the runs whose ``cell_key`` is one of
theirs, in the presets' order, so a section finds exactly what its driver in ``scripts/`` ran, under any results root
(cells run with extra overrides, e.g. a shorter window, are found with the same overrides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pandas as pd

from kvbench.core.config import available
from kvbench.report.collect import FRAMES, Collection
from kvbench.sweep.presets import Preset, cell_keys, fitting, other_models


def select(got: Collection, presets: Sequence[Preset], overrides: Sequence[str] = ()) -> Collection:
    """The rows of ``got`` that are runs of the presets' cells (each run with ``overrides`` added), in the
    presets' order, each with the ``preset`` it belongs to. A preset the overrides do not apply to shows nothing.
    Unless the overrides name a model, a preset's cells run on any packaged model (``model=NAME``, as the drivers
    take it) are its cells too."""
    where: dict[tuple[str, str], tuple[int, str]] = {}  # (kind, cell_key) -> (order, preset)
    models = sorted({str(m) for f in got.frames().values() if "model" in f for m in f["model"].dropna()}
                    & set(available("model")))
    for preset in presets:  # a preset the overrides do not apply to has no cells here
        variants = [list(overrides)]
        if not any(o.startswith("model=") for o in overrides):
            variants += [[*overrides, f"model={m}"] for m in other_models(preset, models)]
        for extra in variants:
            for key in cell_keys(preset, fitting(preset.kind, extra)):
                where.setdefault((preset.kind, key), (len(where), preset.name))

    def pick_rows(df: pd.DataFrame, kind: str) -> pd.DataFrame:
        if df.empty or "cell_key" not in df:
            return df.iloc[0:0]
        found = [where.get((kind, k)) for k in df["cell_key"]]
        keep = [f is not None for f in found]
        out = df[keep].assign(_cell=[f[0] for f in found if f], preset=[f[1] for f in found if f])
        return out.sort_values("_cell", kind="stable").drop(columns="_cell").reset_index(drop=True)

    return replace(got, **{FRAMES[kind]: pick_rows(df, kind) for kind, df in got.frames().items()})
