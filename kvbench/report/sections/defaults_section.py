"""The defaults section: one row per compression run of the default model (``configs/base.yaml``) under the report's
dirs, in rising stream rate, with the columns a reader of the project's front page compares (rate, distance to the
bound, the NLL change with its interval, throughput). The README's results table is this section of the
``reproduce`` study's evidence; ``results/README.md`` has both models."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from kvbench.core.config import CONFIG_DIR
from kvbench.report.collect import Collection
from kvbench.report.sections.frontier_section import RATE_NOTE, exact_tokens, frontier_label
from kvbench.report.sections.per_model import model_first, trace_notes
from kvbench.report.sections.section_types import Figures, Table
from kvbench.report.tables import pick

DEFAULTS_COLUMNS = pick("model", "compressor", "params", "context_len", "exact_tokens", "stream_bits_per_element",
                        "bits_per_element", "bits_per_element_amortized", "bits_per_token", "x_bound",
                        "compression_ratio", "delta_nll_ci_text", "nll_verdict", "eval_documents_n", "encode_MBps", "decode_MBps",
                        formats={"encode_MBps": "x", "decode_MBps": "x", "compression_ratio": "x"})
NOTE = ("x bound: bits/token over the measured H(token | history) of the same windows; ratio: against the 16-bit "
        "cache, codec bits charged; enc / dec MB/s: of 16-bit KV, from the run itself (timed cells under the "
        "benchmark lock, one torch thread).")


def default_model() -> str:
    """The model every command measures unless told otherwise."""
    entries = OmegaConf.load(CONFIG_DIR / "base.yaml").defaults
    return next(e["model"] for e in entries if isinstance(e, DictConfig) and "model" in e)


def defaults(got: Collection) -> tuple[list[Table], Figures]:
    d = got.table
    if not d.empty and "model" in d:
        d = d[d["model"] == default_model()]
    if d.empty:
        return [Table("defaults", d, DEFAULTS_COLUMNS, "every run", empty="_no runs_\n")], {}
    d = d.assign(compressor=frontier_label(d), exact_tokens=exact_tokens(d))
    d = model_first(d, "context_len", "stream_bits_per_element")
    note = f"{trace_notes(d)} {RATE_NOTE} {NOTE}".strip()
    return [Table("defaults", d, DEFAULTS_COLUMNS, "every run", note, csv=True)], {}
