"""The stepcost section: every stepcost run under the report's dirs (``python -m kvbench stepcost``), one row per
stage of a model-running coder, its seconds per coded token (median over rounds, with the rounds' lowest and
highest) and its ratio to the plain cached decode step measured in the same run."""

from __future__ import annotations

from kvbench.report.collect import Collection
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

STAGE_COLUMNS = pick("model", "compressor", "torch_threads", "coded_tokens", "stage", "s_per_token", "s_per_token_lo",
                     "s_per_token_hi", "over_step", "what")
NOTE = ("Seconds per coded token: the median over rounds after a warm-up round (the stages in a seeded random order "
        "within each round), with the rounds' lowest and highest; each ratio is to the plain cached decode step of "
        "the same run. decode includes decode_prefill.")


def stepcost(got: Collection) -> tuple[list[Table], Figures]:
    d = got.stepcost
    if not d.empty:
        d = d.sort_values(["model", "run_id"], kind="stable")
    return [Table("stepcost", d, STAGE_COLUMNS, "a model-running coder's stages against a plain decode step", NOTE,
                  empty="_no stepcost runs_\n", csv=True)], {}
