"""The report's sections, listed here once: the function that builds each one's tables and figures (one module per
section, ``<name>_section``), with the presets whose cells it shows read from the study that names it
(``configs/study/``, :mod:`kvbench.sweep.studies_config`). ``overview``, ``defaults``, ``decode``, ``stepcost``,
``reliability``, ``scale`` and ``capacity`` show every run under the report's dirs; which runs a study section shows is
:func:`kvbench.report.sections.selection.select`.
"""

from __future__ import annotations

from kvbench.report.sections.accuracy_section import accuracy_study
from kvbench.report.sections.capacity_section import capacity
from kvbench.report.sections.decode_section import decode
from kvbench.report.sections.defaults_section import defaults
from kvbench.report.sections.dev_split_section import dev_recall, dev_split
from kvbench.report.sections.end_to_end_section import end_to_end
from kvbench.report.sections.eviction_ruler_section import eviction_ruler
from kvbench.report.sections.eviction_section import eviction
from kvbench.report.sections.frontier_rd_section import frontier_rd
from kvbench.report.sections.frontier_ruler_section import frontier_ruler, ruler_long
from kvbench.report.sections.frontier_section import frontier
from kvbench.report.sections.overview_section import overview
from kvbench.report.sections.per_vector_section import per_vector
from kvbench.report.sections.prefix_sharing_section import prefix_sharing
from kvbench.report.sections.reliability_section import reliability
from kvbench.report.sections.ruler_section import ruler_study
from kvbench.report.sections.scale_section import scale
from kvbench.report.sections.section_types import Figures, Section, Table
from kvbench.report.sections.selection import select
from kvbench.report.sections.sequential_section import sequential
from kvbench.report.sections.stepcost_section import stepcost
from kvbench.report.sections.transfer_section import long_context, transfer
from kvbench.sweep.studies_config import Study, studies

__all__ = ["SECTIONS", "Figures", "Section", "Table", "section", "select"]


#: section name -> the function that builds its tables and figures, in the report's order
BUILDERS = {"overview": overview, "per_vector": per_vector, "sequential": sequential, "prefix_sharing": prefix_sharing,
            "accuracy": accuracy_study, "ruler": ruler_study, "end_to_end": end_to_end, "frontier": frontier,
            "frontier_ruler": frontier_ruler, "ruler_long": ruler_long, "frontier_rd": frontier_rd,
            "transfer": transfer, "long_context": long_context,
            "eviction": eviction, "eviction_ruler": eviction_ruler, "dev_split": dev_split, "dev_recall": dev_recall,
            "defaults": defaults, "decode": decode,
            "stepcost": stepcost, "reliability": reliability, "scale": scale, "capacity": capacity}
#: sections with no study: they show every run under the report's dirs
ALL_RUNS = ("overview", "defaults", "decode", "stepcost", "reliability", "scale", "capacity")


def _registry() -> dict[str, Section]:
    """Each section with the presets of the study that names it (configs/study/)."""
    by_section: dict[str, Study] = {}
    for s in studies().values():
        if s.section not in BUILDERS or s.section in ALL_RUNS or s.section in by_section:
            raise ValueError(f"study {s.name} names section {s.section!r}: one study a section, of "
                             f"{sorted(set(BUILDERS) - set(ALL_RUNS))}")
        by_section[s.section] = s
    lacking = sorted(set(BUILDERS) - set(ALL_RUNS) - set(by_section))
    if lacking:
        raise ValueError(f"no study in configs/study/ names section(s) {lacking}")
    return {name: Section(name, () if name in ALL_RUNS else by_section[name].presets, build)
            for name, build in BUILDERS.items()}


SECTIONS = _registry()


def section(name: str) -> Section:
    if name not in SECTIONS:
        raise ValueError(f"unknown report section {name!r}; one of {sorted(SECTIONS)}")
    return SECTIONS[name]
