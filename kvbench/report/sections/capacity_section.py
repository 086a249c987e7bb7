"""The capacity section: every capacity run under the report's dirs (``python -m kvbench capacity``, one per model
and memory budget), as what its budget holds of each coder's cache and the decode it projects, beside the published
figures the runs quote. Every projected column says so; what each rests on is the docstring of
:mod:`kvbench.report.capacity`, and the tables' notes say it again from the runs' own fields."""

from __future__ import annotations

import pandas as pd

from kvbench.report.collect import Collection, numeric
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import Column, pick

PROJECTED, PUBLISHED = "projected", "published"


def _c(key: str, header: str, fmt: str = "s") -> Column:
    return Column(key, header, header.replace("%", r"\%").replace("#", r"\#"), fmt)


SETTING_COLUMNS = [
    _c("model", "model"), _c("memory_gb", "memory GB", ",.0f"), _c("weights_gb", "weights GB", ".2f"),
    _c("weights_from", "weights from"), _c("reserve_gb", "reserve GB", ".2f"), _c("kv_budget_gb", "KV GB", ".2f"),
    _c("geometry.n_layers", "layers", "d"), _c("geometry.n_kv_heads", "KV heads", "d"),
    _c("geometry.head_dim", "head_dim", "d"), _c("kv_elements_per_token", "KV elements/token", ",.0f"),
    _c("geometry.max_positions", "positions", ",.0f"), _c("bandwidth_gb_per_s", "bandwidth GB/s (assumed)", ",.0f"),
    _c("evidence_text", "measured figures from")]
FIT_COLUMNS = [
    _c("model", "model"), _c("label", "coder"), *pick("compressor_params.bits", "exact_tokens"),
    _c("stream_bits_per_element", "stream bits/elt (measured)", ".3f"), _c("measured_on", "bits measured on"),
    _c("head_dim_text", "head_dim as the model's?"), *pick("delta_nll_ci_text", "nll_verdict"),
    _c("kv_bytes_per_token", "KV bytes/token", ",.0f"), _c("kv_tokens", "KV tokens (modelled)", ",.0f"),
    _c("capacity_x", "x 16-bit tokens", ".2f")]
DECODE_COLUMNS = [
    _c("model", "model"), _c("label", "coder"), *pick("compressor_params.bits"), _c("context", "context", ",.0f"),
    _c("concurrent", "contexts at once (modelled)", ",.0f"), _c("step_ratio", "step cost x DynamicCache (measured)", ".2f"),
    _c("step_text", "step cost from"), _c("tokens_per_s_memory", "tok/s at DynamicCache's step cost (projected)", ",.0f"),
    _c("tokens_per_s", "decode tok/s (projected)", ",.0f"), _c("vs_16bit", "x 16-bit tok/s (projected)", ".2f")]
PUBLISHED_COLUMNS = [
    _c("setting", "KV cache"), _c("published_model", "model"), _c("hardware", "hardware"),
    _c("kv_capacity_x", "KV capacity x baseline", ".2f"), _c("throughput_of_baseline", "throughput, share of baseline", ".1%"),
    _c("metric", "throughput measured as"), _c("source", "source"), _c("url", "where")]

SETTING_NOTE = ("What each run assumes: GB are 10^9 bytes; the weights as the model's parameter count times its "
                "dtype's bytes (or as given); the reserve is held back for activations, workspaces and the runtime; "
                "the KV memory is what is left. The bandwidth is assumed, not measured.")
FIT_NOTE = ("Measured: each coder's stream bits per element, its fewest within 1% NLL on the model it was measured on "
            "(the windows of that study, the coder's exact 16-bit tokens included at their share of them), and that "
            "cell's NLL interval. Modelled: KV bytes per token = 2 x layers x KV heads x head_dim x bits / 8; KV "
            "tokens = KV memory / KV bytes per token. A per-vector coder's scale or norm overhead depends on "
            "head_dim, so bits measured at another head_dim are that model's, not this one's.")
DECODE_NOTE = ("PROJECTION. Contexts at once: KV tokens / context (none past the model's positions). Decode step at "
               "that batch: (weights + batch x context x KV bytes per token) / bandwidth x the coder's measured "
               "step cost against DynamicCache (the median decode step of its CompressedCache over DynamicCache's in "
               "the same latency run, at the measured context nearest this one; 1 for the 16-bit cache); tok/s = "
               "batch / step. The step costs were measured on a CPU with a small model, not on the accelerator "
               "assumed; a coder without a latency run is not projected (the command that would measure it is "
               "named), and its tok/s at DynamicCache's step cost is what its bytes alone would allow.")
PUBLISHED_NOTE = ("Published figures, quoted as their sources state them (not measured here, on other models and "
                  "serving benchmarks): what a user would compare the projection against.")


def _text(d: pd.DataFrame) -> pd.DataFrame:
    """The columns the tables show as words: where the bits and the step costs come from."""
    def on(r) -> str:
        return "-" if pd.isna(r.get("measured_model")) else f"{r['measured_model']} (head_dim {int(r['measured_head_dim'])})"

    def head(r) -> str:
        if pd.isna(r.get("measured_model")):
            return "-"
        return "yes" if bool(r["head_dim_matches"]) else f"no ({int(r['measured_head_dim'])} vs {int(r['geometry.head_dim'])})"

    def step(r) -> str:
        if r["step_source"] == "measured":
            other = "" if bool(r["step_params_match"]) else ", other params"
            return (f"{r['step_run']} at {int(r['step_context'])} ({r['step_params'] or '-'}{other}; "
                    f"{r['step_model']}, {r['step_device']})")
        if r["step_source"] == "not measured":
            return f"not measured: {r['step_measure']}"
        return str(r["step_source"])

    return d.assign(measured_on=d.apply(on, axis=1), head_dim_text=d.apply(head, axis=1),
                    step_text=d.apply(step, axis=1))


def _order(d: pd.DataFrame) -> pd.DataFrame:
    """Per model, the 16-bit cache first, then the coders by measured model and stream bits."""
    return d.assign(_base=d["measured_model"].notna(), _bits=numeric(d, "stream_bits_per_element")).sort_values(
        ["model", "_base", "measured_model", "_bits", "label", "context"], kind="stable", na_position="first")


def capacity(got: Collection) -> tuple[list[Table], Figures]:
    d = got.capacity
    if d.empty:
        return [Table("capacity", d, DECODE_COLUMNS, "projected decode", DECODE_NOTE, empty="_no capacity runs_\n")], {}
    runs = d.drop_duplicates("run_id").sort_values("model", kind="stable")
    commits = [c for c in runs.columns if c.startswith("evidence.") and c.endswith(".commit")]
    runs = runs.assign(evidence_text=runs.apply(lambda r: "; ".join(
        f"{c.split('.')[1]} at {r[c]}" for c in commits if pd.notna(r[c])), axis=1))
    # the runs' configs are in their evidence; the rows carry what each figure rests on
    proj = _order(_text(d[d["row"] == PROJECTED])).drop(columns=[c for c in d.columns if c.startswith("cfg.")])
    fit = proj.drop_duplicates(["run_id", "label", "measured_model", "bits_run"])
    published = d[d["row"] == PUBLISHED].drop_duplicates(["source", "setting", "published_model"])
    return [Table("capacity", runs, SETTING_COLUMNS, "what each run assumes", SETTING_NOTE),
            Table("capacity", fit, FIT_COLUMNS, "what fits", FIT_NOTE),
            Table("capacity", proj, DECODE_COLUMNS, "projected decode", DECODE_NOTE, csv=True),
            Table("capacity", published, PUBLISHED_COLUMNS, "published figures, for comparison", PUBLISHED_NOTE)], {}
