"""The per-vector quantizers' section: rate, distortion and speed per bit width."""

from __future__ import annotations

from kvbench.report import study_figures
from kvbench.report.collect import Collection, series_label
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

PER_VECTOR_COLUMNS = pick("compressor", "compressor_params.bits", "bits_per_element", "rel_mse_k", "rel_mse_v",
                          "delta_nll", "delta_nll_ci_text", "encode_MBps", "decode_MBps",
                          formats={"rel_mse_k": ".4f", "rel_mse_v": ".4f"})


def per_vector(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table.assign(series=series_label(got.table))  # bits move a point along its compressor's curve
    table = Table("per_vector", d.assign(compressor=d["series"]), PER_VECTOR_COLUMNS, "per-vector quantizers", csv=True)
    return [table], {"per_vector": study_figures.per_vector(d)}
