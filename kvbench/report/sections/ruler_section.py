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
RULER_COLUMNS = pick("model", "compressor", "bits_per_element", "task", "length", "n", "acc_base", "acc_comp", "diff",
                     "diff_ci_text", "paired_test", "p_value", "detectable_diff", formats={"bits_per_element": ".2f"})
RULER_BASE_NOTE = ("16-bit accuracy per task family and length (the baseline side of every paired run; the same "
                   "examples in each); chance: the score of content-free answerers on the same examples. A task under "
                   "chance + {margin} is flagged near chance: the model cannot do it, so it cannot lose it, and it is "
                   "left out of the pooled verdicts.")
RULER_NOTE = ("Paired on the same examples; diff = compressed - 16-bit with its 95% bootstrap interval over the "
              "examples (pooled: stratified by task, over every task clear of chance), as each run's summary states "
              "it; the test is exact McNemar where every score is 0 or 1, a paired permutation test where scores give "
              "partial credit; detectable: the true change a two-sided test at the 5% level detects 80% of the time "
              "with this many examples and the observed variance.")
RULER_CELL_COLUMNS = pick("model", "compressor", "bits_per_element", "protocol", "length", "n_examples", "eval_s",
                          "eval_s_per_example", "contexts_from_store", "load_average_1min",
                          formats={"bits_per_element": ".2f"})
RULER_CELL_NOTE = ("Each cell as it ran: its protocol (context_only: the context compressed, the question prefilled on "
                   "top uncompressed, as kvpress does; query_aware: the prompt but its last token compressed), its "
                   "examples over every family and length, and its wall time (the compressed pass, with the context's 16-bit "
                   "prefill and the baseline's answer where neither the process nor the store (paths.prefills) had "
                   "them: the first cell over a set of examples pays for both, later ones load them; from store: the "
                   "contexts whose prefill was loaded); load: the machine's one-minute load average when the cell "
                   "started.")
POOLED = "pooled (clear of chance)"


def _pooled_row(g: pd.DataFrame) -> pd.DataFrame:
    """A run's pooled row: its summary's own (``overall_informative.*``: stratified bootstrap over the tasks clear of
    chance); for a run whose summary predates it, pooled here from its tasks' figures."""
    first = g.iloc[[0]]
    lengths = numeric(g, "length").dropna().unique()
    length = float(lengths[0]) if len(lengths) == 1 else math.nan  # one length: the pooled row is at it
    own = {c.removeprefix("overall_informative."): first[c].iloc[0] for c in g.columns
           if c.startswith("overall_informative.")}
    if own.get("n") is not None and numeric(pd.DataFrame([own]), "n").gt(0).all():
        return first.assign(task=POOLED, length=length, family="pooled", **own)
    return first.assign(task=POOLED, length=length, family="pooled", **pool_tasks(g[~g["near_chance"]]))


def ruler_rows(ev: pd.DataFrame) -> pd.DataFrame:
    """The RULER tasks' eval rows with their family, length and near-chance flag (from the 16-bit accuracy, for
    runs that predate the flag too), then per run its ``pooled`` row over the tasks clear of chance."""
    from kvbench.measure.evaluation.evaluate import NEAR_CHANCE_MARGIN
    from kvbench.measure.evaluation.ruler import PREFIX

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
    if "p_value" not in d:  # summaries that predate the paired permutation test
        d["p_value"] = numeric(d, "mcnemar_p")
    d = d.assign(compressor=series_label(d, exclude=()))
    pooled = [_pooled_row(g) for _, g in d.groupby("run_id", sort=False)]
    out = pd.concat([d, *pooled], ignore_index=True)
    order = {r: i for i, r in enumerate(d["run_id"].drop_duplicates())}
    out = out.sort_values("run_id", key=lambda r: r.map(order), kind="stable").reset_index(drop=True)
    out["diff_ci_text"] = [interval_text(lo, hi, "+.3f") for lo, hi in zip(numeric(out, "ci95_low"), numeric(out, "ci95_high"))]
    return out


def baseline_table(d: pd.DataFrame, stem: str) -> Table:
    """The 16-bit cache's accuracy per model and task of :func:`ruler_rows`' rows, with chance and the near-chance
    flag."""
    from kvbench.measure.evaluation.evaluate import NEAR_CHANCE_MARGIN

    tasks = d[d["family"] != "pooled"]
    base = tasks.drop_duplicates(["model", "task"]) if "model" in tasks else tasks.drop_duplicates("task")
    return Table(stem, base, RULER_BASE_COLUMNS, "16-bit baseline per task",
                 RULER_BASE_NOTE.format(margin=NEAR_CHANCE_MARGIN))


def ruler_study(got: Collection) -> tuple[list[Table], Figures]:
    d = ruler_rows(got.evals)
    if d.empty:
        return [], {"ruler": (None, "no RULER eval run (python -m kvbench eval tasks=[ruler])")}
    tasks = d[d["family"] != "pooled"]
    cells = d[d["family"] == "pooled"]
    tables = [baseline_table(d, "ruler"),
              Table("ruler", d, RULER_COLUMNS, "accuracy with the compressed cache, per task and pooled", RULER_NOTE, csv=True),
              Table("ruler", cells, RULER_CELL_COLUMNS, "the cells", RULER_CELL_NOTE)]
    figures = {f"ruler_{model}": study_figures.accuracy_vs_bits(g) for model, g in by_model(tasks)}
    figures |= {f"ruler_pooled_{model}": study_figures.pooled_accuracy_vs_bits(g) for model, g in by_model(cells)}
    return tables, figures
