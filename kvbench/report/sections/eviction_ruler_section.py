"""The eviction methods on RULER at the leaderboard's compression ratios: each method's pooled accuracy against the
fraction of tokens it evicts (kvpress's compression ratio), as the leaderboard draws it, and against the bits per
element it holds beside the FP8 cache; each cell paired with the 16-bit cache on the same examples and, example by
example, with the FP8 cache."""

from __future__ import annotations

import pandas as pd

from kvbench.report import study_figures
from kvbench.report.collect import Collection, numeric
from kvbench.report.sections.frontier_ruler_section import RULER_MARGIN, paired_cells
from kvbench.report.sections.frontier_section import is_reference
from kvbench.report.sections.per_model import by_model
from kvbench.report.sections.ruler_section import baseline_table
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

CELL_COLUMNS = pick("model", "compressor", "compressor_params.keep", "press_ratio", "bits_per_element", "length", "n",
                    "acc_base", "acc_comp", "diff", "diff_ci_text", "p_value", "ruler_vs_ref", "ruler_vs_ref_ci_text",
                    "ruler_vs_ref_verdict", "encode_s_per_context", "eval_s_per_example", "contexts_from_store",
                    formats={"bits_per_element": ".2f"})
CELL_NOTE = ("RULER pooled over the families clear of chance (the 16-bit accuracy decides which, the same for every "
             "cell of a model), context-only: the context compressed, the question fed on top uncompressed. keep: the "
             "mean fraction of a (layer, KV head)'s tokens the method keeps (adaptive budgets share it unequally); "
             "compression ratio: kvpress's, one minus keep, the fraction evicted; bits/elt: the kept tokens' 16-bit "
             "KV and their coded positions over every element of the full cache; diff: compressed - 16-bit on the "
             "same examples with its 95% bootstrap interval stratified by task; minus FP8's: the cell's per-example "
             "scores minus the FP8 cache's on the same examples, no worse when its interval's lower end is at or "
             "above {margin:+g}, worse when its upper end is below it; encode s/context: the encoder's wall time per "
             "compressed context, the model passes a method scores with (KVzip's reconstruction, the queries of "
             "SnapKV and ExpectedAttention) included; s/example: the cell's wall time per example, prefill and "
             "generation included.")


def press_ratio(d: pd.DataFrame) -> pd.Series:
    """Per row, the compression ratio as kvpress's leaderboard states it: the fraction of tokens evicted, one minus
    the mean kept fraction (blank for a coder that keeps every token, or a budget given as a token count)."""
    return 1.0 - numeric(d, "compressor_params.keep")


def eviction_ruler(got: Collection) -> tuple[list[Table], Figures]:
    paired = paired_cells(got)
    if paired is None:
        return [], {"eviction_ruler": (None, "no RULER eval run (python scripts/eviction_ruler.py)")}
    d, cells = paired
    cells = cells.assign(press_ratio=press_ratio(cells))
    order = {m: i for i, m in enumerate(cells["model"].drop_duplicates())}
    cells = cells.assign(_m=cells["model"].map(order), _r=is_reference(cells)).sort_values(
        ["_m", "_r", "compressor", "press_ratio"], ascending=[True, False, True, True], kind="stable")
    tables = [baseline_table(d, "eviction_ruler"),
              Table("eviction_ruler", cells, CELL_COLUMNS, "RULER pooled accuracy, every cell",
                    CELL_NOTE.format(margin=-RULER_MARGIN), csv=True)]
    evicting = cells[numeric(cells, "press_ratio").notna()]
    figures = {f"eviction_ruler_{model}": study_figures.pooled_accuracy_vs_ratio(g.assign(series=g["compressor"]))
               for model, g in by_model(evicting)}
    figures |= {f"eviction_ruler_bits_{model}": study_figures.pooled_accuracy_vs_bits(
        g.assign(series=g["compressor"])) for model, g in by_model(cells)}
    return tables, figures
