"""The overview section: every run under the report's dirs, its tables and figures."""

from __future__ import annotations

from kvbench.report.collect import Collection, best_at_tolerance
from kvbench.report.figures import FIGURES
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import BEST_COLUMNS, COLUMNS, EVAL_COLUMNS, LATENCY_COLUMNS, RESTORE_COLUMNS

RESTORE_NOTE = ("Restore rows: encode, decode, first-token forward and prefill measured; transfer at each bandwidth "
                "modelled as bits / bandwidth (python -m kvbench restore).")


def overview(got: Collection) -> tuple[list[Table], Figures]:
    df = got.table
    tables = [Table("runs", df, COLUMNS, f"{len(df)} runs", empty="_no runs_\n", csv=True),
              Table("best_at_1pct_nll", best_at_tolerance(df), BEST_COLUMNS, "highest ratio at <= 1% NLL regression",
                    empty="_no run has both delta_nll and nll_base_\n")]
    for stem, table, columns in (("eval", got.evals, EVAL_COLUMNS), ("latency", got.latency, LATENCY_COLUMNS),
                                 ("restore", got.restore, RESTORE_COLUMNS)):
        if not table.empty:
            note = RESTORE_NOTE if stem == "restore" else ""
            tables.append(Table(stem, table, columns, f"{stem}: {table['run_id'].nunique()} runs", note))
    frames = {"runs": df, "evals": got.evals, "latency": got.latency, "restore": got.restore}
    return tables, {name: make(frames[frame]) for name, (frame, make) in FIGURES.items()}
