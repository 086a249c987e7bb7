"""The report's tables: each column defined once (summary key, headers, number format) and one writer, whose
subclasses give the markup (Markdown, booktabs LaTeX).

A table is a list of :class:`Column`; columns no row fills are left out, so one list serves summaries of every
age. Plain ``(key, header, tex, fmt)`` tuples work as columns too.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import pandas as pd

from kvbench.report.collect import plain


class Column(NamedTuple):
    key: str  # the summary key (flattened with dots) or derived column it shows
    header: str  # Markdown header
    tex: str  # LaTeX header
    fmt: str  # a format() spec, or "s" text, "d" an integer, "x" a ratio spanning decades (format_ratio)


def _col(key: str, header: str, fmt: str = "s", tex: str | None = None) -> Column:
    return Column(key, header, header if tex is None else tex, fmt)


# Every column a report table shows.
CATALOGUE = {c.key: c for c in (
    _col("model", "model"),
    _col("dataset", "dataset"),
    _col("compressor", "compressor"),
    _col("params", "params"),
    _col("chosen", "chosen on dev"),
    _col("default", "default (all budgets)"),
    _col("dev_objective", "objective (rel. dNLL + rel. recall dNLL)", ".4f"),
    _col("rank_stream", "rank by stream", "d"),
    _col("rank_charged", "rank by charged", "d"),
    _col("rank_amortized", "rank by amortized", "d"),
    _col("workload", "workload"),
    _col("sharing.share_rate", "share rate", ".2f"),
    _col("context_len", "context", "d"),
    _col("bits_per_element", "bits/elt", ".3f"),
    _col("bits_per_element_amortized", "bits/elt amortized", ".3f"),
    _col("bits_per_token", "bits/token", ",.1f"),
    _col("bound_bits_per_token", "bound bits/token", ".2f"),
    _col("x_bound", "x bound", "x", r"$\times$ bound"),
    _col("compression_ratio", "ratio", ".2f"),
    _col("press_ratio", "compression ratio (evicted)", ".3f"),
    _col("delta_nll", "dNLL (nats)", "+.4f", r"$\Delta$NLL (nats)"),
    _col("delta_nll_ci_text", "dNLL 95% CI", "s", r"$\Delta$NLL 95\% CI"),
    _col("nll_verdict", "within 1%?"),
    # the documents the verdict rests on: its interval resamples them (kvbench.measure.metrics.intervals)
    _col("eval_documents_n", "docs", "d"),
    _col("nll_recall_base", "recall NLL base", ".3f"),
    _col("delta_nll_recall", "recall dNLL", "+.3f", r"recall $\Delta$NLL"),
    _col("delta_nll_recall_ci_text", "recall 95% CI", "s"),
    _col("recall_vs_ref", "minus FP8's", "+.3f"),
    _col("recall_vs_ref_ci_text", "minus FP8's 95% CI", "s"),
    _col("recall_vs_ref_verdict", "no worse than FP8?"),
    _col("ruler_vs_ref", "minus FP8's", "+.3f"),
    _col("ruler_vs_ref_ci_text", "minus FP8's 95% CI", "s"),
    _col("ruler_vs_ref_verdict", "no worse than FP8?"),
    _col("windows", "windows"),
    _col("nll_base", "NLL base", ".3f"),
    _col("rel_mse_k", "rel MSE K", ".2e"),
    _col("rel_mse_v", "rel MSE V", ".2e"),
    # the error the model's own queries see at the scored positions (kvbench/measure/metrics/attention_error.py)
    _col("attn_logit_rel_mse", "attn logit rel MSE", ".2e"),
    _col("attn_output_rel_err", "attn output rel err", ".2e"),
    _col("attn_logit_mse", "attn logit MSE (softmax units)", ".2e"),
    _col("attn_kl", "attn KL nats", ".2e"),
    # the Gaussian rate-distortion rate at the run's own relative MSEs (kvbench.measure.metrics.rate_distortion)
    _col("rd_bits_per_element", "Gaussian R(D) bits/elt", ".3f"),
    _col("rd_bits_per_element_pre_rope", "R(D) pre-RoPE", ".3f"),
    # the same at the coder's own weighted objective, K and V free to trade error
    _col("rd_bits_per_element_weighted", "R(D) weighted", ".3f"),
    _col("rd_key_weight", "R(D) key weight", "g"),
    _col("rd_gap_coder", "quantizer + entropy gap", ".3f"),
    _col("rd_times", "x R(D)", ".2f"),
    _col("rd_gap_split", "K/V split gap", ".3f"),
    _col("encode_MBps", "enc MB/s", ",.0f"),
    _col("decode_MBps", "dec MB/s", ",.0f"),
    _col("lossless", "lossless"),
    _col("n_sequences", "windows", "d"),
    _col("compressor_params.bits", "bits", "g"),  # nominal: what the compressor was asked for
    # bitstreams alone against the codec's fitted parameters (charged once per run in bits_per_element)
    _col("stream_bits_per_element", "stream bits/elt", ".3f"),
    _col("stream_compression_ratio", "stream ratio", ".2f"),
    _col("codec_bits", "codec bits (once)", ",.0f"),
    _col("exact_tokens", "exact 16-bit tokens"),
    # eviction: the kept fraction, what is always kept, how the kept KV is stored, what the positions cost
    _col("compressor_params.keep", "keep", "g"),
    _col("always_kept", "always kept"),
    _col("kept_coding", "kept KV"),
    _col("positions_bits_per_element", "positions bits/elt", ".3f"),
    _col("vs_random", "vs random, same keep"),
    _col("encode_s_per_seq", "encode s/seq", ".2f"),
    _col("decode_s_per_seq", "decode s/seq", ".2f"),
    _col("encode_ms_per_token", "encode ms/token", ".3f"),
    _col("decode_ms_per_token", "decode ms/token", ".3f"),
    _col("paper_gap_closed", "paper's 914,000x -> measured"),
    # where a bitstream's bits go, per token (coded: the stream's parts; ideal: the coder's model, sum of -log2 p)
    _col("part.k_residual", "K residual", ",.1f"),
    _col("part.k_residual_ideal", "K residual ideal", ",.1f"),
    _col("part.v_residual", "V residual", ",.1f"),
    _col("part.v_residual_ideal", "V residual ideal", ",.1f"),
    _col("part.scales", "scales", ".1f"),
    _col("part.tokens", "token ids", ".2f"),
    _col("part.tokens_ideal", "token ids ideal", ".2f"),
    _col("part.frame", "frame+bounds", ".2f"),
    _col("side_info_bits", "side info (bits, once)", ",.0f"),
    _col("part.side_info", "side info / token", ",.1f"),
    # multi-session workloads: sharing statistics, the prefix cache's replay, shared prefixes' KV
    _col("cfg.workload.target_share_rate", "target share", ".1f"),
    _col("sharing.sessions", "sessions", "d"),
    _col("sharing.tokens", "tokens", "d"),
    _col("sharing.ideal_hit_rate", "ideal hit (block)", ".3f"),
    _col("sharing.dedup_ratio", "tokens / unique", ".2f"),
    _col("budget", "budget (tokens)"),
    _col("prefix_cache.hit_rate", "hit rate", ".3f"),
    _col("prefix_cache.request_hit_rate", "requests hit", ".3f"),
    _col("prefix_cache.prefill_tokens_saved", "prefill tokens saved", "d"),
    _col("prefix_cache.memory_held_mean_tokens", "mean held", ".0f"),
    _col("prefix_cache.memory_held_max_tokens", "max held", "d"),
    _col("max_abs_err_k", "max abs err K", "g"),
    _col("shared_prefix_kv.identical_pairs", "prefixes with identical KV", "d"),
    _col("shared_prefix_kv.pairs", "shared prefixes", "d"),
    _col("shared_prefix_kv.max_abs_diff", "max KV diff", "g"),
    _col("shared_prefix_kv.tokens_after_first_difference", "tokens after first difference", "d"),
    # task accuracy (eval.json, one row per task)
    _col("task", "task"),
    _col("n", "n", "d"),
    _col("acc_base", "acc 16-bit", ".3f"),
    _col("acc_comp", "acc compressed", ".3f"),
    _col("diff", "diff", "+.3f"),
    _col("stderr_diff", "stderr", ".3f"),
    _col("stderr_base", "stderr 16-bit", ".3f"),
    _col("stderr_comp", "stderr compressed", ".3f"),
    _col("diff_ci_text", "diff 95% CI", "s", r"diff 95\% CI"),
    _col("mcnemar_p", "McNemar p", ".3g", "McNemar $p$"),
    _col("paired_test", "test"),
    _col("p_value", "p", ".3g", "$p$"),
    _col("detectable_diff", "detectable (80% power)", ".2f", r"detectable (80\% power)"),
    _col("identical_responses", "same responses", "d"),
    _col("family", "task family"),
    _col("length", "tokens", "d"),
    _col("chance", "chance", ".2f"),
    _col("near_chance_text", "near chance"),
    _col("smallest_significant_diff", "smallest significant change", ".2f"),
    # an eval cell as it ran (eval.json)
    _col("protocol", "protocol"),
    _col("n_examples", "examples", "d"),
    _col("eval_s", "eval s", ".0f"),
    _col("eval_s_per_example", "s/example", ".2f"),
    _col("encode_s_per_context", "encode s/context", ".2f"),
    _col("contexts_from_store", "from store", "d"),
    _col("load_average_1min", "load (1 min)", ".1f"),
    _col("measure_s", "cell s", ",.0f"),
    # end-to-end latency (latency.json, one row per context and cache)
    _col("context", "context", "d"),
    _col("cache", "cache"),
    _col("prefill_s", "prefill s", ".3f"),
    _col("compress_s", "compress s", ".3f"),
    _col("decode_median_ms", "decode ms (median)", ".1f"),
    _col("decode_p95_ms", "decode ms (p95)", ".1f"),
    _col("tokens_per_s", "tokens/s", ".1f"),
    _col("dtype", "cache dtype"),
    _col("tokens_per_s_iqr", "tokens/s IQR", ".2f"),
    _col("dynamic_tokens_per_s", "16-bit tokens/s", ".1f"),
    _col("dynamic_tokens_per_s_iqr", "16-bit tokens/s IQR", ".2f"),
    _col("bytes_held", "bytes held", ",.0f"),
    _col("mb_held", "MB held", ".2f"),
    _col("peak_mem_mb", "peak RSS MB", ".0f"),  # the whole process's, model included
    _col("ratio_tokens_per_s", "tok/s ratio", ".3f"),
    _col("ratio_bytes", "bytes ratio", ".3f"),
    _col("tokens_match_dynamic", "same tokens", ".2f"),
    _col("load_1m", "load", ".1f"),
    # one latency run against the 16-bit cache of the same run, per context
    _col("bytes_ratio", "memory saved (x)", ".2f", r"memory saved ($\times$)"),
    _col("speed_ratio", "decode tokens/s vs 16-bit", ".3f"),
    _col("ms_compressed", "decode ms/token", ".1f"),
    _col("ms_dynamic", "16-bit decode ms/token", ".1f"),
    # restore-from-storage time to first token (restore.json, one row per context and link bandwidth)
    _col("bandwidth_gbps", "link Gbit/s", "g"),
    _col("ttft_s", "TTFT compressed s", ".4f"),
    _col("ttft_16bit_s", "TTFT 16-bit s", ".4f"),
    _col("ttft_prefill_s", "TTFT prefill s", ".4f"),
    _col("fastest", "fastest"),
    _col("decode_s", "decode s", ".4f"),
    _col("first_token_s", "first token s", ".4f"),
    _col("crossover_16bit_gbps", "16-bit crossover Gbit/s", ".3g"),
    _col("crossover_prefill_gbps", "prefill crossover Gbit/s", ".3g"),
    _col("crossover_16bit_spread", "16-bit crossover, rounds' range"),
    _col("crossover_prefill_spread", "prefill crossover, rounds' range"),
    _col("encode_s", "encode s", ".4f"),
    _col("first_token_matches_prefill", "first token = prefill's"),
    # a model-running coder's stages against a plain cached decode step (stepcost.json, one row per stage)
    _col("stage", "stage"),
    _col("s_per_token", "s/token", ".4g"),
    _col("coded_tokens", "coded tokens", ",.0f"),
    _col("s_per_token_lo", "lowest round", ".4g"),
    _col("s_per_token_hi", "highest round", ".4g"),
    _col("what", "what it times"),
    _col("over_step", "x plain decode step", ".3f", r"$\times$ plain decode step"),
    _col("torch_threads", "threads", "d"),
    # what mutated streams did to a compressor's decoder (reliability.json, one row per mutation)
    _col("case", "compressor (variant)"),
    _col("content_check", "content check"),
    _col("frame_mutations", "frame mutations", ",.0f"),
    _col("frame_rejected", "refused by the frame", ",.0f"),
    _col("reached_decoder", "reached the decoder", ",.0f"),
    _col("rejected_bitstream_error", "rejected: BitstreamError", ",.0f"),
    _col("rejected_value_error", "rejected: ValueError", ",.0f"),
    _col("decoded_identical", "decoded as the original", ",.0f"),
    _col("decoded_differently", "decoded to another cache", ",.0f"),
    _col("differently_share", "share decoded to another cache", ".1%"),
    _col("known_limit", "of which the known limit", ",.0f"),
    _col("failures", "failures", ",.0f"),
    _col("tests_passed", "tests passed"),
    _col("tests_s", "tests s", ".1f"),
    _col("mutation", "mutation"),
    _col("mutation_class", "mutates"),
    _col("mutation_n", "mutations", ",.0f"),
    _col("mutation_rejected", "rejected", ",.0f"),
    _col("mutation_identical", "decoded as the original", ",.0f"),
    _col("mutation_differently", "decoded to another cache", ",.0f"),
    _col("mutation_failures", "failures", ",.0f"),
    # wall time and peak memory of each step of a cell against the context (scale.json, one row per step)
    _col("step", "step"),
    _col("windows_held", "windows held", "d"),
    _col("windows_at_max", "windows held there", "d"),
    _col("dataset_at_max", "text there"),
    _col("wall_s", "wall s", ",.2f"),
    _col("rss_before_gb", "RSS before GB", ".2f"),
    _col("step_peak_rss_gb", "step peak RSS GB", ".2f"),
    _col("estimate_gb", "estimated peak GB", ".2f"),
    _col("nll", "NLL", ".4f"),
    _col("lengths", "lengths", "d"),
    _col("context_max", "largest context", ",.0f"),
    _col("wall_fixed_s", "fitted s: fixed", ",.2f"),
    _col("wall_s_per_1k", "fitted s per 1k tokens", ",.3f"),
    _col("wall_s_per_1k_sq", "fitted s per (1k tokens)^2", ".4f", r"fitted s per (1k tokens)$^2$"),
    _col("wall_fit_max_rel_err", "fit's largest rel. error", ".1%", r"fit's largest rel.\ error"),
    _col("quadratic_share_at_max", "quadratic share at largest", ".0%", r"quadratic share at largest"),
    _col("rss_fixed_gb", "fitted peak GB: fixed", ".2f"),
    _col("rss_gb_per_1k", "fitted peak GB per 1k tokens", ".3f"),
    _col("peak_at_max_gb", "peak GB at largest", ".2f"),
    _col("position_limit", "model's positions", ",.0f"),
    _col("machine_memory_gb", "machine memory GB", ".1f"),
    _col("reach_extrapolated", "context at machine memory (extrapolated)", ",.0f"),
    # distance to the bound (results/README.md)
    _col("which", "decoder"),
    _col("windows_text", "windows x tokens"),
    _col("x_bound_text", "x bound"),
    _col("elements_per_token", "K+V elements/token", ",.0f"),
    _col("paper_x_bound_text", "3 bits/elt over the bound"),
)}


def pick(*keys: str, formats: dict[str, str] | None = None) -> list[Column]:
    """The catalogue's columns for ``keys``, in that order; ``formats`` replaces a column's format by key."""
    formats = formats or {}
    return [CATALOGUE[k]._replace(fmt=formats.get(k, CATALOGUE[k].fmt)) for k in keys]


# Headline columns of every compression cell. Whole multiples of the bound: this table is for scanning many runs,
# the best-points table gives two decimals near the bound.
COLUMNS = pick("model", "dataset", "compressor", "params", "workload", "sharing.share_rate", "context_len",
               "bits_per_element", "bits_per_token", "bound_bits_per_token", "x_bound", "compression_ratio",
               "delta_nll", "delta_nll_ci_text", "nll_verdict", "eval_documents_n", "rel_mse_k", "rel_mse_v", "encode_MBps",
               "decode_MBps", "lossless", formats={"x_bound": ",.0f"})
# The best point of each curve within 1% NLL, decided on the interval, per set of evaluated windows.
BEST_COLUMNS = pick("model", "dataset", "windows", "compressor", "params", "context_len", "bits_per_element",
                    "bits_per_token", "x_bound", "compression_ratio", "delta_nll", "delta_nll_ci_text", "nll_base")
RESTORE_COLUMNS = pick("model", "compressor", "params", "context", "bandwidth_gbps", "ttft_s", "ttft_16bit_s",
                       "ttft_prefill_s", "fastest", "decode_s", "first_token_s", "prefill_s", "crossover_16bit_gbps",
                       "crossover_prefill_gbps")
EVAL_COLUMNS = pick("model", "compressor", "params", "bits_per_element", "task", "n", "acc_base", "acc_comp", "diff",
                    "stderr_diff", "mcnemar_p")
LATENCY_COLUMNS = pick("model", "compressor", "params", "context", "cache", "prefill_s", "compress_s",
                       "decode_median_ms", "decode_p95_ms", "tokens_per_s", "bytes_held")


def format_ratio(x: float) -> str:
    """A ratio spanning decades: two decimals near 1 (1.08 x the bound), none far from it (36,360 x)."""
    return f"{x:.2f}" if abs(x) < 100 else f"{x:,.0f}"


def format_value(v, spec: str) -> str:
    """One cell: ``-`` for a missing value, else ``v`` in the column's format (see :class:`Column`)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if spec == "s":
        return plain(v)
    if spec == "d":
        return f"{int(v)}"
    if spec == "x":
        return format_ratio(float(v))
    try:
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        return format(float(v), spec)
    except (TypeError, ValueError):
        return str(v)


def shown(df: pd.DataFrame, columns: Iterable[Sequence[str]]) -> list[Column]:
    """The columns some row of ``df`` fills (not missing, not empty text)."""
    cols = [Column(*c) for c in columns]
    return [c for c in cols if c.key in df and df[c.key].notna().any() and (df[c.key].astype(str) != "").any()]


def _left(c: Column) -> bool:
    return c.fmt == "s"  # text reads from the left, numbers line up on the right


class Markup(abc.ABC):
    """One table writer: the shown columns, a row per row of the frame, each cell formatted and escaped. A
    subclass gives the markup: what stands above the rows, how a row is joined, what ends the table."""

    empty = ""  # the whole output when no column is shown
    row_start, cell_sep, row_end = "", "", ""
    tail: tuple[str, ...] = ()

    def escape(self, s: str) -> str:
        return s

    @abc.abstractmethod
    def head(self, cols: list[Column], caption: str) -> list[str]: ...

    def row(self, cells: Iterable[str]) -> str:
        return self.row_start + self.cell_sep.join(cells) + self.row_end

    def write(self, df: pd.DataFrame, columns: Iterable[Sequence[str]], caption: str = "") -> str:
        cols = shown(df, columns)
        if not cols:
            return self.empty
        lines = self.head(cols, caption)
        for _, r in df.iterrows():
            lines.append(self.row(self.escape(format_value(r[c.key], c.fmt)) for c in cols))
        lines += self.tail
        return "\n".join(lines) + "\n"


class Markdown(Markup):
    empty = "_no runs_\n"
    row_start, cell_sep, row_end = "| ", " | ", " |"

    def escape(self, s: str) -> str:
        return s.replace("|", r"\|")

    def head(self, cols: list[Column], caption: str) -> list[str]:
        return [self.row(c.header for c in cols), "|" + "|".join("---" if _left(c) else "---:" for c in cols) + "|"]


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
        "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "$": r"\$", "|": r"\textbar{}"}


class Latex(Markup):
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``); the caption becomes a comment above it."""

    empty = "% no runs\n"
    cell_sep, row_end = " & ", r" \\"
    tail = (r"\bottomrule", r"\end{tabular}")

    def escape(self, s: str) -> str:
        return "".join(_TEX.get(ch, ch) for ch in s)

    def head(self, cols: list[Column], caption: str) -> list[str]:
        spec = "".join("l" if _left(c) else "r" for c in cols)
        return [f"% {caption}" if caption else "% kvbench report", f"\\begin{{tabular}}{{{spec}}}", r"\toprule",
                self.row(c.tex for c in cols), r"\midrule"]


def to_markdown(df: pd.DataFrame, columns: Iterable[Sequence[str]] = COLUMNS) -> str:
    return Markdown().write(df, columns)


def to_latex(df: pd.DataFrame, columns: Iterable[Sequence[str]] = COLUMNS, caption: str = "") -> str:
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``)."""
    return Latex().write(df, columns, caption)
