"""The RULER section: long-context task accuracy with the compressed cache, per task and pooled over the tasks
clear of chance."""

from __future__ import annotations

import math

import pandas as pd

from kvbench.report import study_figures
from kvbench.report.collect import Collection, interval_text, numeric, pool_tasks, series_label
from kvbench.report.sections.per_model import by_model
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

RULER_BASE_COLUMNS = pick("model", "family", "length", "n", "acc_base", "chance", "near_chance_text")
RULER_COLUMNS = pick("model", "compressor", "bits_per_element", "task", "n", "acc_base", "acc_comp", "diff",
                     "diff_ci_text", "mcnemar_p", "smallest_significant_diff", formats={"bits_per_element": ".2f"})
RULER_BASE_NOTE = ("16-bit accuracy per task family and length (the baseline side of every paired run; the same "
                   "examples in each). A task under chance + {margin} is flagged near chance: the model cannot do it, "
                   "so it cannot lose it, and it is left out of the pooled verdicts.")
RULER_NOTE = ("Paired on the same examples; diff = compressed - 16-bit with its 95% interval; pooled = every task "
              "clear of chance; smallest significant change = 6 one-way flips over n, the least change McNemar can "
              "call at p < 0.05 with these examples: a smaller true change reads as no change.")


def ruler_rows(ev: pd.DataFrame) -> pd.DataFrame:
    """The RULER tasks' eval rows with their family, length and near-chance flag (from the 16-bit accuracy, for
    runs that predate the flag too), then per run a ``pooled`` row over the tasks clear of chance."""
    from kvbench.measure.evaluation.evaluate import NEAR_CHANCE_MARGIN
    from kvbench.measure.evaluation.ruler import PREFIX
    from kvbench.measure.evaluation.stats import smallest_significant_flips

    if ev.empty or "task" not in ev:
        return ev
    d = ev[ev["task"].astype(str).str.startswith(PREFIX)].copy()
    if d.empty:
        return d
    parts = d["task"].astype(str).str.rsplit("_", n=1)
    d["family"] = parts.str[0]
    d["length"] = parts.str[1].str.removesuffix("k").astype(int) * 1024
    d["chance"] = numeric(d, "chance").fillna(0.0)
    d["near_chance"] = numeric(d, "acc_base") < d["chance"] + NEAR_CHANCE_MARGIN
    d["near_chance_text"] = d["near_chance"].map({True: "yes", False: ""})
    d["smallest_significant_diff"] = smallest_significant_flips() / numeric(d, "n")
    d = d.assign(compressor=series_label(d, exclude=()))
    pooled = []
    for _, g in d.groupby("run_id", sort=False):
        clear = g[~g["near_chance"]]
        pooled.append(g.iloc[[0]].assign(task="pooled (clear of chance)", **pool_tasks(clear), length=math.nan, family="pooled"))
    out = pd.concat([d, *pooled], ignore_index=True)
    order = {r: i for i, r in enumerate(d["run_id"].drop_duplicates())}
    out = out.sort_values("run_id", key=lambda r: r.map(order), kind="stable").reset_index(drop=True)
    out["diff_ci_text"] = [interval_text(lo, hi, "+.3f") for lo, hi in zip(numeric(out, "ci95_low"), numeric(out, "ci95_high"))]
    return out


def ruler_study(got: Collection) -> tuple[list[Table], Figures]:
    from kvbench.measure.evaluation.evaluate import NEAR_CHANCE_MARGIN

    d = ruler_rows(got.evals)
    if d.empty:
        return [], {"ruler": (None, "no RULER eval run (python -m kvbench eval tasks=[ruler])")}
    tasks = d[d["family"] != "pooled"]
    base = tasks.drop_duplicates(["model", "task"]) if "model" in tasks else tasks.drop_duplicates("task")
    tables = [Table("ruler", base, RULER_BASE_COLUMNS, "16-bit baseline per task", RULER_BASE_NOTE.format(margin=NEAR_CHANCE_MARGIN)),
              Table("ruler", d, RULER_COLUMNS, "accuracy with the compressed cache, per task and pooled", RULER_NOTE, csv=True)]
    figures = {f"ruler_{model}": study_figures.accuracy_vs_bits(g) for model, g in by_model(tasks)}
    return tables, figures
