"""The report's sections, listed here once: the presets whose cells each study section shows, and the function
that builds its tables and figures (one module per section, ``<name>_section``). ``overview`` shows every run under
the report's dirs; which runs a study section shows is :func:`kvbench.report.sections.selection.select`.
"""

from __future__ import annotations

from kvbench.report.sections.accuracy_section import accuracy_study
from kvbench.report.sections.end_to_end_section import end_to_end
from kvbench.report.sections.eviction_section import eviction
from kvbench.report.sections.frontier_section import frontier
from kvbench.report.sections.overview_section import overview
from kvbench.report.sections.per_vector_section import per_vector
from kvbench.report.sections.prefix_sharing_section import prefix_sharing
from kvbench.report.sections.ruler_section import ruler_study
from kvbench.report.sections.section_types import Figures, Section, Table
from kvbench.report.sections.selection import select
from kvbench.report.sections.sequential_section import sequential
from kvbench.sweep.presets import Preset

__all__ = ["SECTIONS", "Figures", "Section", "Table", "section", "select"]


def _presets(kind: str, *names: str) -> tuple[Preset, ...]:
    return tuple(Preset(kind, n) for n in names)


MATCHED_BITS = ("matched_bits", "matched_bits_turboquant")
FRONTIER = ("frontier_kvtc", "frontier_kvtc_window0", "frontier_aquakv", "frontier_kvquant", "frontier_turboquant",
            "frontier_kivi", "frontier_delta")
SECTIONS = {s.name: s for s in (
    Section("overview", (), overview),
    Section("per_vector", _presets("run", "per_vector_turboquant", "per_vector_kivi"), per_vector),
    Section("sequential", _presets("run", "sequential", "sequential_delta", "sequential_delta_bits",
                                   "sequential_speculative"), sequential),
    Section("prefix_sharing", _presets("run", "prefix_sharing_sweep", "prefix_sharing_budget",
                                       "prefix_sharing_families", "prefix_sharing_compose",
                                       "prefix_sharing_compose_kivi", "prefix_sharing_compose_pipeline"),
            prefix_sharing),
    Section("accuracy", _presets("eval", *MATCHED_BITS), accuracy_study),
    Section("ruler", _presets("eval", "ruler", "ruler_kivi", "ruler_turboquant", "ruler_delta", "ruler_eviction"), ruler_study),
    Section("end_to_end", _presets("latency", *MATCHED_BITS, "latency_lossless", "latency_model"), end_to_end),
    Section("frontier", _presets("run", *FRONTIER), frontier),
    # the per-vector quantizers of the frontier presets are the eviction study's reference at similar stored bits
    Section("eviction", _presets("run", "eviction", "eviction_inner", "frontier_kivi", "frontier_turboquant"), eviction),
)}


def section(name: str) -> Section:
    if name not in SECTIONS:
        raise ValueError(f"unknown report section {name!r}; one of {sorted(SECTIONS)}")
    return SECTIONS[name]
