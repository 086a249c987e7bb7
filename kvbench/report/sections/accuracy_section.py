"""The accuracy section: task accuracy with the compressed cache in the loop, paired against the 16-bit cache."""

from __future__ import annotations

from kvbench.report.collect import Collection, series_label, with_pooled
from kvbench.report.figures import accuracy
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

ACCURACY_COLUMNS = pick("compressor", "bits_per_element", "task", "n", "acc_base", "stderr_base", "acc_comp",
                        "stderr_comp", "diff", "diff_ci_text", "mcnemar_p", "identical_responses",
                        formats={"bits_per_element": ".2f"})
ACCURACY_NOTE = ("Paired on the same examples; diff = compressed - 16-bit with its 95% interval; McNemar = exact "
                 "test on the examples that flipped; same responses = raw responses equal to the baseline's.")


def accuracy_study(got: Collection) -> tuple[list[Table], Figures]:
    ev = with_pooled(got.evals)
    ev = ev.assign(compressor=series_label(ev, exclude=())) if not ev.empty else ev
    return ([Table("accuracy", ev, ACCURACY_COLUMNS, "task accuracy, compressed against 16-bit", ACCURACY_NOTE,
                   csv=True)],
            {"accuracy": accuracy(ev)})
