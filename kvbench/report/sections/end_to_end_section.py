"""The end-to-end section: decode latency and memory of the compressed cache against DynamicCache in the same run."""

from __future__ import annotations

import json
import math

import pandas as pd

from kvbench.report import study_figures
from kvbench.report.collect import Collection, numeric, series_label
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

END_TO_END_COLUMNS = pick("compressor", "context", "prefill_s", "compress_s", "decode_median_ms", "decode_p95_ms",
                          "tokens_per_s", "mb_held", "peak_mem_mb", "ratio_tokens_per_s", "ratio_bytes",
                          "tokens_match_dynamic", "load_1m",
                          formats={"prefill_s": ".2f", "compress_s": ".2f", "decode_median_ms": ".0f",
                                   "decode_p95_ms": ".0f", "tokens_per_s": ".2f"})
END_TO_END_NOTE = ("Ratios are compressed / DynamicCache of the same run (compare within a run: the machine's load "
                   "differs between runs); peak RSS is the whole process's, model included.")


def _mean_of_list(text) -> float:
    try:
        values = json.loads(text) if isinstance(text, str) else []
        return float(pd.Series(values, dtype=float).mean()) if values else math.nan
    except (TypeError, ValueError):
        return math.nan


def end_to_end_rows(lat: pd.DataFrame) -> pd.DataFrame:
    """Latency rows with the compressed cache's ratios to the 16-bit cache of its run (on its own rows), MB and the
    run's mean load; the 16-bit rows are named after the run they belong to."""
    if lat.empty:
        return lat
    label = series_label(lat, exclude=())
    compressed = lat["cache"].astype(str) == "compressed"

    def ratio(what: str) -> list[float]:  # summary["ratios"][context][what], flattened per context
        return [pd.to_numeric(r.get(f"ratios.{int(r['context'])}.{what}"), errors="coerce") if ok else math.nan
                for (_, r), ok in zip(lat.iterrows(), compressed)]

    return lat.assign(compressor=label.where(compressed, "DynamicCache (run of " + label + ")"),
                      mb_held=numeric(lat, "bytes_held") / 1e6, peak_mem_mb=numeric(lat, "peak_mem_bytes") / 1e6,
                      ratio_tokens_per_s=ratio("tokens_per_s"), ratio_bytes=ratio("bytes_held"),
                      load_1m=lat["loadavg_1m"].map(_mean_of_list) if "loadavg_1m" in lat else math.nan,
                      series=label)


def end_to_end(got: Collection) -> tuple[list[Table], Figures]:
    lat = end_to_end_rows(got.latency)
    return ([Table("end_to_end", lat, END_TO_END_COLUMNS, "decode latency and memory", END_TO_END_NOTE, csv=True)],
            {"end_to_end": study_figures.end_to_end(lat)})
