"""One cell of any measuring command, from config overrides or a composed config: reuse the newest finished run
of it or measure and write one. The CLI, sweeps and study scripts all go through :func:`run_cell`."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from kvbench.core.config import compose, make_compressor
from kvbench.core.rss import peak_fields, start_cell
from kvbench.store.results import Outcome, cell_key, latest, reuse_or_measure, root_of
from kvbench.sweep.commands import function, measuring
from kvbench.sweep.config_check import read_config


def compose_cell(kind: str, overrides: list[str]) -> Any:
    """The config ``python -m kvbench KIND OVERRIDES`` would run."""
    return compose(list(overrides), config_name=measuring(kind).config)


def formatter(kind: str):
    return function(measuring(kind).format)


def key_of(cfg: Any) -> str:
    """The ``cell_key`` that :func:`run_cell` files this config's runs under."""
    return cell_key(OmegaConf.to_container(cfg, resolve=True), make_compressor(cfg.get("compressor")).keyed())


def finished(kind: str, cfg: Any, same_code: bool = False) -> dict | None:
    """The newest finished run of the cell ``cfg`` under its results root (any code version unless
    ``same_code``), or None: what :func:`run_cell` would reuse."""
    measuring(kind)
    return latest(root_of(OmegaConf.to_container(cfg, resolve=True)), kind, key_of(cfg), same_code=same_code)


def run_cell(kind: str, cfg: Any, handle: Any = None, resume: Any = None, extra: dict | None = None,
             **measure_kw: Any) -> Outcome:
    """Reuse the newest finished run of ``cfg`` (``resume``: default ``cfg.metrics.resume``; see
    :func:`kvbench.store.results.resume_mode`) or measure it with ``kind``'s function and write it, with the peak
    resident memory (:func:`kvbench.core.rss.peak_fields`) and ``extra`` fields (e.g. the machine's load while it
    ran) added to the measured summary. The config is read first (:func:`kvbench.sweep.config_check.read_config`):
    a bad field fails here, before anything is loaded or written."""
    cfg = read_config(cfg)
    compressor = make_compressor(cfg.get("compressor"))
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    measure = function(measuring(kind).measure)
    resume = cfg.metrics.resume if resume is None else resume

    def measured() -> tuple[dict, list[dict]]:
        start_cell()  # the cell's own peak memory, apart from earlier cells of this process
        summary, rows = measure(cfg, compressor, handle, **measure_kw)
        return {**summary, **peak_fields(), **(extra or {})}, rows

    return reuse_or_measure(kind, cfg_dict, compressor.name, compressor.keyed(), measured, resume)
