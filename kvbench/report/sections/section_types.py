"""What a report section is: the cells it shows and how it builds its tables and figures from their runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd

from kvbench.report.collect import Collection
from kvbench.report.tables import Column
from kvbench.sweep.presets import Preset


@dataclass(frozen=True)
class Table:
    stem: str  # written to <out>/<stem>.md and .tex; the tables of one stem share the files, each under its title
    frame: pd.DataFrame
    columns: Sequence[Column]
    title: str = ""
    note: str = ""  # a paragraph above the Markdown table: the setting, the units
    empty: str | None = None  # the Markdown when the frame is empty; None leaves the table out
    csv: bool = False  # also <stem>.csv: every column of every row shown


Figures = dict[str, tuple]  # name -> (Figure, "") or (None, why nothing was drawn)


@dataclass(frozen=True)
class Section:
    name: str
    presets: tuple[Preset, ...]  # the cells it shows; () shows every run
    build: Callable[[Collection], tuple[list[Table], Figures]]

