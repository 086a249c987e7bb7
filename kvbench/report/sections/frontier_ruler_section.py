"""The frontier's third quality axis: RULER (at the lengths its cells ran) under the context-only protocol for each
coder's fewest stream bits within 1% next-token NLL on the frontier, the FP8 cache as the reference row and eviction
at its byte cost. Each cell is paired with the 16-bit cache on the same examples (its run's own pooled change) and,
example by example, with the reference cache (a coder minus FP8, pooled over the tasks clear of chance)."""

from __future__ import annotations

import json
import math

import pandas as pd

from kvbench.measure.metrics.reference_diff import reference_verdict
from kvbench.report import study_figures
from kvbench.report.collect import Collection, interval_text, numeric
from kvbench.report.sections.frontier_section import frontier_label, is_reference, lowest_within, rate_ranks
from kvbench.report.sections.per_model import by_model, model_first
from kvbench.report.sections.ruler_section import baseline_table, ruler_rows
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

#: how much lower a coder's pooled RULER accuracy may be than the reference cache's and still count as no worse
RULER_MARGIN = 0.01

CELL_COLUMNS = pick("model", "compressor", "compressor_params.bits", "bits_per_element", "length", "n", "acc_base", "acc_comp",
                    "diff", "diff_ci_text", "p_value", "detectable_diff", "ruler_vs_ref", "ruler_vs_ref_ci_text",
                    "ruler_vs_ref_verdict", "eval_s_per_example", "contexts_from_store",
                    formats={"bits_per_element": ".2f"})
BEST_COLUMNS = pick("model", "compressor", "compressor_params.bits", "bits_per_element", "length", "acc_comp", "diff",
                    "diff_ci_text", "ruler_vs_ref", "ruler_vs_ref_ci_text", "ruler_vs_ref_verdict", "rank_stream",
                    formats={"bits_per_element": ".2f"})
CELL_NOTE = ("RULER at the context length in the tokens column, every family, pooled over the families clear of "
             "chance (the 16-bit accuracy decides which, the same for every cell of a model); bits/elt: the bits "
             "held per KV element of the coded contexts, counted from the stored segments (eviction: the kept tokens' 16-bit "
             "KV and positions); diff: "
             "compressed - 16-bit on the same examples with its 95% bootstrap interval stratified by task, the paired "
             "test and the change it detects 80% of the time; minus FP8's: the cell's per-example scores minus the FP8 "
             "cache's on the same examples, pooled and bootstrapped the same way, no worse when its interval's lower "
             "end is at or above {margin:+g}, worse when its upper end is below it; s/example: the cell's wall time "
             "over its examples (the contexts' 16-bit prefills and the baseline's answers loaded from the store where "
             "it says so).")
RANK_NOTE = ("Per coder and model, the cell with the fewest bits per element whose pooled RULER accuracy is not shown "
             "lower than the FP8 cache's by more than {margin:g} (its verdict no worse or unresolved), ranked within "
             "its model; the reference row itself is left out.")


def _scores(cell: pd.DataFrame) -> pd.DataFrame:
    """One row per example of ``cell``'s tasks clear of chance: ``task``, ``doc_id``, ``comp`` (its score)."""
    rows = []
    for _, t in cell[~cell["near_chance"]].iterrows():
        ids, comp = t.get("doc_ids"), t.get("scores_comp")
        if not isinstance(ids, str) or not isinstance(comp, str):
            return pd.DataFrame(columns=["task", "doc_id", "comp"])
        rows += [{"task": t["task"], "doc_id": i, "comp": c} for i, c in zip(json.loads(ids), json.loads(comp))]
    return pd.DataFrame(rows, columns=["task", "doc_id", "comp"])


def versus_reference(tasks: pd.DataFrame, cells: pd.DataFrame, margin: float = RULER_MARGIN) -> pd.DataFrame:
    """``cells`` (one pooled row per run) with each run's pooled RULER accuracy minus the reference cache's on the
    same examples (``ruler_vs_ref``, its stratified bootstrap interval and verdict); blank where the model has no
    reference run, or a run kept no per-example scores or scored other examples."""
    from kvbench.measure.evaluation.stats import paired_scores

    cells = cells.copy()
    out = {k: [math.nan] * len(cells) for k in ("ruler_vs_ref", "ruler_vs_ref_ci_text", "ruler_vs_ref_verdict")}
    refs = cells[is_reference(cells)]
    for i, (_, row) in enumerate(cells.iterrows()):
        same = refs[refs["model"] == row["model"]]
        if same.empty:
            continue
        mine = _scores(tasks[tasks["run_id"] == row["run_id"]])
        ref = _scores(tasks[tasks["run_id"] == same.iloc[0]["run_id"]])
        paired = mine.merge(ref, on=["task", "doc_id"], suffixes=("", "_ref"))
        if paired.empty or len(paired) != len(mine) or len(paired) != len(ref):
            continue
        got = paired_scores(paired["comp_ref"].to_numpy(float), paired["comp"].to_numpy(float),
                            task=paired["task"].tolist())
        low, high = got["ci95_low"], got["ci95_high"]
        out["ruler_vs_ref"][i] = got["diff"]
        out["ruler_vs_ref_ci_text"][i] = interval_text(low, high, "+.3f")
        # accuracy is better higher: the loss relative to the reference is the difference negated
        out["ruler_vs_ref_verdict"][i] = reference_verdict((-high, -low), margin)
    return cells.assign(**out)


def paired_cells(got: Collection) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """RULER's rows of ``got`` with the frontier's coder labels, and each cell's pooled row paired with the 16-bit
    cache and with the reference cache; None without a RULER eval run."""
    d = ruler_rows(got.evals)
    if d.empty:
        return None
    d = d.assign(compressor=frontier_label(d))
    return d, versus_reference(d[d["family"] != "pooled"], d[d["family"] == "pooled"])


def frontier_ruler(got: Collection, stem: str = "frontier_ruler",
                   paired: tuple[pd.DataFrame, pd.DataFrame] | None = None) -> tuple[list[Table], Figures]:
    """Every cell's pooled accuracy paired with the 16-bit cache and with the reference cache, and per coder the
    fewest bits not shown below the reference's; the tables and figures under ``stem`` (a study reusing them, which
    may hand over its :func:`paired_cells`)."""
    paired = paired or paired_cells(got)
    if paired is None:
        return [], {stem: (None, f"no RULER eval run (python scripts/{stem}.py)")}
    cells = paired[1]
    cells = cells.assign(stream_bits_per_element=numeric(cells, "bits_per_element"))
    cells = model_first(cells, "bits_per_element")
    best = rate_ranks(lowest_within(cells[~is_reference(cells)].assign(series=lambda x: x["compressor"]),
                                    verdict="ruler_vs_ref_verdict", passing=("no worse", "unresolved")))
    tables = [Table(stem, cells, CELL_COLUMNS, "RULER pooled accuracy, every cell",
                    CELL_NOTE.format(margin=-RULER_MARGIN), csv=True),
              Table(stem, best, BEST_COLUMNS,
                    "fewest bits per element whose RULER accuracy is not shown below FP8's, per coder and model",
                    RANK_NOTE.format(margin=RULER_MARGIN),
                    empty="_no coded cell whose RULER accuracy is not shown below the FP8 cache's_\n")]
    # a line per curve of the frontier (KVTC with and without its window apart), as its tables name them
    figures = {f"{stem}_{model}": study_figures.pooled_accuracy_vs_bits(g.assign(series=g["compressor"]))
               for model, g in by_model(cells)}
    return tables, figures


def ruler_long(got: Collection) -> tuple[list[Table], Figures]:
    """RULER at the leaderboard's length (configs/study/ruler_long.yaml): the 16-bit cache's accuracy per family, which
    says the families each model clears of chance at this length (only those are pooled), then the frontier's RULER
    tables of its cells."""
    paired = paired_cells(got)
    tables, figures = frontier_ruler(got, "ruler_long", paired)
    if paired is None:
        return tables, figures
    return [baseline_table(paired[0], "ruler_long"), *tables], figures
