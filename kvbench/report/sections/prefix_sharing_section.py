"""The prefix-sharing section: the mixed-workload sweep, single-family workloads, the prefix cache under a
budget, and compressors alone and inside the trie."""

from __future__ import annotations

import pandas as pd

from kvbench.report import study_figures
from kvbench.report.collect import Collection, numeric, series_label
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

# a share rate or ratio near 1 needs three decimals to show what dedup gained; bits per token run to six figures
PREFIX_FORMATS = {"sharing.share_rate": ".3f", "bits_per_token": ",.0f", "compression_ratio": ".3f",
                  "sharing.dedup_ratio": ".3f"}
SWEEP_COLUMNS = pick("cfg.workload.target_share_rate", "sharing.share_rate", "prefix_cache.hit_rate",
                     "sharing.sessions", "sharing.tokens", "compressor", "bits_per_token", "compression_ratio",
                     "sharing.dedup_ratio", "lossless", "max_abs_err_k", "shared_prefix_kv.identical_pairs",
                     "shared_prefix_kv.pairs", "shared_prefix_kv.max_abs_diff",
                     "shared_prefix_kv.tokens_after_first_difference", formats=PREFIX_FORMATS)
FAMILY_COLUMNS = pick("workload", "sharing.sessions", "sharing.tokens", "sharing.share_rate", "sharing.ideal_hit_rate",
                      "bits_per_token", "compression_ratio", "sharing.dedup_ratio", "lossless",
                      "shared_prefix_kv.identical_pairs", "shared_prefix_kv.pairs", "shared_prefix_kv.max_abs_diff",
                      formats=PREFIX_FORMATS)
BUDGET_COLUMNS = pick("compressor", "budget", "prefix_cache.hit_rate", "prefix_cache.request_hit_rate",
                      "prefix_cache.prefill_tokens_saved", "prefix_cache.memory_held_mean_tokens",
                      "prefix_cache.memory_held_max_tokens", "bits_per_token", "compression_ratio", formats=PREFIX_FORMATS)
COMPOSITION_COLUMNS = pick("workload", "compressor", "bits_per_token", "compression_ratio", "lossless", "rel_mse_k",
                           "rel_mse_v", "delta_nll", "delta_nll_ci_text", formats=PREFIX_FORMATS)


def composition_label(d: pd.DataFrame) -> pd.Series:
    """A compressor alone by its name, inside the trie as trie+<inner>."""
    if d.empty:
        return pd.Series(dtype=str)
    inner = d["compressor_params.inner.name"] if "compressor_params.inner.name" in d else pd.Series(index=d.index)
    return d["compressor"].astype(str).where(inner.isna(), "trie+" + inner.astype(str))


def prefix_sharing(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table
    part = {name: d[d["preset"].str.startswith(f"prefix_sharing_{name}")] if "preset" in d else d.iloc[0:0]
            for name in ("sweep", "families", "budget", "compose")}
    sweep = part["sweep"].assign(series=series_label(part["sweep"], exclude=()))
    families = part["families"].assign(series=series_label(part["families"], exclude=()))
    families = families.sort_values("sharing.share_rate") if "sharing.share_rate" in families else families
    budget = part["budget"].assign(series=series_label(part["budget"], exclude=("budget_tokens",)))
    budget["budget"] = [f"{int(b)}" if pd.notna(b) else "unbounded" for b in numeric(budget, "prefix_cache.budget_tokens")]
    compose = part["compose"].assign(series=composition_label(part["compose"]))
    if not compose.empty:  # each compressor alone, then inside the trie
        inner = compose["series"].str.removeprefix("trie+")
        first = {c: i for i, c in enumerate(dict.fromkeys(inner))}
        compose = compose.assign(_o=inner.map(first), _t=compose["series"].str.startswith("trie+"))
        compose = compose.sort_values(["workload", "_o", "_t"], kind="stable").drop(columns=["_o", "_t"])
    tables = [Table("prefix_sharing", sweep.assign(compressor=sweep["series"]), SWEEP_COLUMNS,
                    "mixed-workload sweep (trie, unbounded)"),
              Table("prefix_sharing", families, FAMILY_COLUMNS, "single-family workloads (trie, unbounded)"),
              Table("prefix_sharing", budget.assign(compressor=budget["series"]), BUDGET_COLUMNS,
                    "prefix cache under a budget"),
              Table("prefix_sharing", compose.assign(compressor=compose["series"]), COMPOSITION_COLUMNS,
                    "composition: each compressor alone and inside the trie")]
    figures = {"prefix_sharing_ratio": study_figures.prefix_sharing_ratio(sweep, families),
               "prefix_sharing_budget": study_figures.prefix_sharing_budget(budget),
               "prefix_sharing_composition": study_figures.prefix_sharing_composition(compose)}
    return tables, figures
