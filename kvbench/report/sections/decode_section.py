"""The decode section: every latency run under the report's dirs (``python -m kvbench latency``), each cache other
than the 16-bit DynamicCache against the DynamicCache measured in the same run: bytes held, decode tokens/s (median
over rounds, with the interquartile range of the rounds), the cache dtype, and the memory-throughput figure."""

from __future__ import annotations

import pandas as pd

from kvbench.report.collect import Collection, numeric, series_label
from kvbench.report.figures import latency_vs_memory
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

MEMORY_COLUMNS = pick("model", "context", "cache", "bytes_ratio", "speed_ratio", "ms_compressed", "ms_dynamic",
                      "tokens_match_dynamic")
DECODE_COLUMNS = pick("model", "context", "cache", "dtype", "bytes_ratio", "speed_ratio", "tokens_per_s",
                      "tokens_per_s_iqr", "dynamic_tokens_per_s", "dynamic_tokens_per_s_iqr", "ms_compressed",
                      "ms_dynamic", "tokens_match_dynamic")


def memory_speed_table(lat: pd.DataFrame) -> pd.DataFrame:
    """Per latency run, context and cache other than the 16-bit DynamicCache: its bytes and decode speed relative to
    the DynamicCache measured in the same run (the compressed cache, and any library baseline such as
    transformers' QuantizedCache)."""
    need = {"run_id", "context", "cache", "bytes_held", "tokens_per_s"}
    if lat.empty or not need <= set(lat.columns):
        return pd.DataFrame()
    dyn = lat[lat["cache"] == "dynamic"].set_index(["run_id", "context"])
    rows = lat[lat["cache"] != "dynamic"].copy()
    if rows.empty or dyn.empty:
        return pd.DataFrame()
    key = list(zip(rows["run_id"], rows["context"]))
    ref = dyn.reindex(key)
    rows["bytes_ratio"] = ref["bytes_held"].to_numpy() / numeric(rows, "bytes_held").to_numpy()
    rows["speed_ratio"] = numeric(rows, "tokens_per_s").to_numpy() / ref["tokens_per_s"].to_numpy()
    rows["ms_compressed"] = numeric(rows, "decode_median_ms")
    rows["ms_dynamic"] = ref["decode_median_ms"].to_numpy() if "decode_median_ms" in ref else float("nan")
    rows["dynamic_tokens_per_s"] = ref["tokens_per_s"].to_numpy()
    rows["dynamic_tokens_per_s_iqr"] = (ref["tokens_per_s_iqr"].to_numpy() if "tokens_per_s_iqr" in ref
                                        else float("nan"))
    name = series_label(rows, exclude=())
    rows["cache"] = [f"{n} (compressed)" if c == "compressed" else str(lbl) if isinstance(lbl, str) else c
                     for c, n, lbl in zip(rows["cache"], name, rows.get("label", pd.Series(index=rows.index)))]
    return rows.sort_values(["model", "context", "bytes_ratio"])


def decode(got: Collection) -> tuple[list[Table], Figures]:
    d = memory_speed_table(got.latency)
    note = ("Each row against the DynamicCache of the same run (same process, same text, caches in a seeded random "
            "order within each round, the median over rounds after a warm-up round); IQR: the interquartile range of "
            "tokens/s over the rounds.")
    return ([Table("decode", d, DECODE_COLUMNS, "resident decode against DynamicCache", note,
                   empty="_no latency runs_\n", csv=True)],
            {"latency_vs_memory": latency_vs_memory(got.latency)})
