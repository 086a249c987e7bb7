"""The dev-split section: hyperparameters of the fitted coders chosen on the development split (``dataset.split=dev``:
windows from documents no test or calibration window comes from), never on the windows the other studies score."""

from __future__ import annotations

import pandas as pd

from kvbench.report.collect import Collection, numeric, param_columns, plain
from kvbench.report.sections.frontier_section import recall_vs_reference
from kvbench.report.sections.per_model import model_first
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

DEV_COLUMNS = pick("model", "compressor", "compressor_params.bits", "params", "stream_bits_per_element",
                   "delta_nll", "delta_nll_ci_text", "nll_verdict", "delta_nll_recall", "delta_nll_recall_ci_text",
                   "dev_objective", "eval_documents_n", "chosen", "default")
NO_DEV_RUN = "_no run on the development split (dataset.split=dev)_\n"
#: a candidate competes only if its stream rate is within this factor of the lowest of its coder and budget
RATE_SLACK = 1.05
DEV_NOTE = ("Every candidate on the development split (dataset.split=dev: as many windows as a test run scores, from "
            "other documents; the calibration windows are the test runs' own). The objective weighs both quality axes "
            "alike: the next-token NLL change over the base NLL plus the recall-probe NLL change over the recall base "
            "(each a relative loss). Per model, coder and bit budget the chosen candidate is the one with the lowest "
            f"objective among those whose stream bits/elt is within {RATE_SLACK - 1:.0%} of the lowest of that coder and "
            "budget (a candidate that spends more bits on the same budget does not win by it); a coder's default (one "
            "setting for every budget) is the setting whose objective, summed over the budgets, is lowest among those at "
            "matched rate at every budget. The test windows are never scored here. A run on the test split is not "
            "shown.")


def dev_objective(d: pd.DataFrame) -> pd.Series:
    """The selection objective of each run: ``delta_nll / nll_base + delta_nll_recall / nll_recall_base``, the two
    quality axes' relative losses summed (next-token NLL alone wins by where its error falls, and pays on the recall
    probe). A run without a recall figure is scored on next-token NLL alone."""
    nll = numeric(d, "delta_nll") / numeric(d, "nll_base")
    if "delta_nll_recall" not in d:
        return nll
    return nll + (numeric(d, "delta_nll_recall") / numeric(d, "nll_recall_base")).fillna(0.0)


def dev_choice(d: pd.DataFrame) -> pd.DataFrame:
    """The dev runs of ``d`` with ``chosen`` = ``yes`` on the lowest :func:`dev_objective` per (model, compressor,
    bits) among the runs at matched rate (stream bits per element at most :data:`RATE_SLACK` times the group's
    lowest), and ``default`` = ``yes`` on the runs of each coder's default setting."""
    if d.empty or "cfg.dataset.split" not in d:
        return d.iloc[0:0]
    dev = d[d["cfg.dataset.split"].astype(str) == "dev"].copy()
    if dev.empty:
        return dev
    keys = [dev[c].astype(str) for c in ("model", "compressor", "compressor_params.bits") if c in dev]
    dev["dev_objective"] = score = dev_objective(dev)
    if "stream_bits_per_element" in dev:
        rate = numeric(dev, "stream_bits_per_element")
        score = score.where(rate <= rate.groupby(keys).transform("min") * RATE_SLACK)
    best = score.groupby(keys).idxmin().dropna()
    dev["chosen"] = ["yes" if i in set(best) else "" for i in dev.index]
    dev["default"] = _defaults(dev, score)
    return model_first(dev)


def _defaults(dev: pd.DataFrame, score: pd.Series) -> list[str]:
    """``yes`` on the runs of each (model, compressor)'s default setting: its hyperparameters apart from the budget,
    with the lowest objective summed over the budgets, among the settings competing (``score`` not NaN) at all."""
    others = [c for c in param_columns(dev) if c != "compressor_params.bits"]
    setting = pd.Series([" ".join(plain(v) for v in row) for row in dev[others].itertuples(index=False)],
                        index=dev.index, dtype=object)
    coder = dev["model"].astype(str) + "\0" + dev["compressor"].astype(str)
    budget = dev.get("compressor_params.bits", pd.Series("", index=dev.index)).astype(str)
    budgets = budget.groupby(coder).transform("nunique")
    per = pd.DataFrame({"coder": coder, "setting": setting, "score": score, "budgets": budgets})
    sums = per.groupby(["coder", "setting"]).agg(total=("score", "sum"), n=("score", "count"), want=("budgets", "first"))
    sums = sums[sums["n"] == sums["want"]]
    if sums.empty:
        return [""] * len(dev)
    best = set(sums.reset_index().loc[lambda t: t.groupby("coder")["total"].idxmin(), ["coder", "setting"]]
               .itertuples(index=False, name=None))
    return ["yes" if (c, st) in best else "" for c, st in zip(coder, setting)]


def dev_split(got: Collection) -> tuple[list[Table], Figures]:
    return [Table("dev_split", dev_choice(got.table), DEV_COLUMNS, "candidates on the development split", DEV_NOTE,
                  empty=NO_DEV_RUN, csv=True)], {}


RECALL_COLUMNS = pick("model", "compressor", "compressor_params.bits", "params", "stream_bits_per_element",
                      "delta_nll", "delta_nll_ci_text", "nll_verdict", "delta_nll_recall", "delta_nll_recall_ci_text",
                      "recall_vs_ref", "recall_vs_ref_ci_text", "recall_vs_ref_verdict", "dev_objective",
                      "eval_documents_n", "chosen")
RECALL_NOTE = ("Candidates for the recall goal on the development split: a coder at 2 stream bits per element (a quarter of "
               "the FP8 cache's) whose recall-probe loss is no larger than FP8's, measured here on the same 16 "
               "development windows as the FP8 row; minus FP8's: a candidate's recall-probe NLL minus the FP8 cache's on "
               "the same copy spans, paired 95% interval over documents then blocks. The rule above chooses among a "
               "coder's candidates; a candidate whose recall loss stays above FP8's on these windows does not go on to "
               "the test windows.")


def dev_recall(got: Collection) -> tuple[list[Table], Figures]:
    d = dev_choice(got.table)
    return [Table("dev_recall", recall_vs_reference(d, got) if not d.empty else d, RECALL_COLUMNS,
                  "the recall goal's candidates on the development split", RECALL_NOTE,
                  empty=NO_DEV_RUN, csv=True)], {}
