"""The studies, one config each in ``configs/study/<name>.yaml``: the presets whose cells it runs and its report
section shows, the command they run under, the findings page its driver writes, the driver's options, and the cells
``scripts/reproduce.sh`` measures of it for results/README.md. The report's section registry
(:mod:`kvbench.report.sections`), the drivers in ``scripts/`` and reproduce.sh all read them here.

A study's fields:

- ``section``: its report section (``kvbench/report/sections/<section>_section.py``);
- ``command``: the measuring command its presets run under (``python -m kvbench COMMAND -m +experiment=PRESET``);
- ``presets``: the presets in ``configs/experiment/``, in the order their cells run and the section lists them;
- ``borrowed``: those of ``presets`` that another study owns (every preset is owned by exactly one study);
- ``findings``: the evidence-backed page under the results root its driver rebuilds (``accuracy.md``: results/accuracy.md), or
  null: a study without a page of its own (a page is published only when rebuilt from committed evidence);
- ``driver``: the options of :func:`kvbench.studies.main`: ``lock`` (each measured cell under the benchmark
  lock), ``isolate`` (one process per cell), ``runs`` (where under the results root its runs go), ``slow``
  (compressor configs run last), and ``threads`` (torch threads its driver runs with; null: torch's default);
- ``reproduce``: ``--only`` patterns (:func:`kvbench.studies.matching`) of the cells reproduce.sh measures, per
  model: those under ``every_model`` with ``{model}`` replaced by the model's name, then those under its name.

    python -m kvbench.sweep.studies_config reproduce STUDY MODEL   # its reproduce patterns, one a line

Only omegaconf is loaded here (a driver reads its options before torch is imported).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbench.store.paths import repo_root

STUDY_DIR = repo_root() / "configs" / "study"
FIELDS = ("section", "command", "presets", "borrowed", "findings", "driver", "reproduce")
DRIVER_FIELDS = ("lock", "isolate", "runs", "slow", "threads")
EVERY_MODEL = "every_model"


@dataclass(frozen=True)
class Driver:
    lock: bool = False
    isolate: bool = False
    runs: str = ""
    slow: tuple[str, ...] = ()
    threads: int | None = None


@dataclass(frozen=True)
class Study:
    name: str  # configs/study/<name>.yaml
    section: str
    command: str
    preset_names: tuple[str, ...]
    borrowed: tuple[str, ...] = ()
    findings: str | None = None
    driver: Driver = field(default_factory=Driver)
    reproduce: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def presets(self) -> tuple[Any, ...]:
        """Its presets as :class:`kvbench.sweep.presets.Preset` (imported here: it loads torch)."""
        from kvbench.sweep.presets import Preset

        return tuple(Preset(self.command, n) for n in self.preset_names)

    @property
    def owned(self) -> tuple[str, ...]:
        return tuple(n for n in self.preset_names if n not in self.borrowed)

    def options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`kvbench.studies.main` for this study's driver."""
        d = self.driver
        return {"runs": d.runs, "lock": d.lock, "isolate": d.isolate, "slow": d.slow, "findings": self.findings}

    def reproduce_patterns(self, model: str) -> list[str]:
        """The ``--only`` patterns of the cells reproduce.sh measures of this study on ``model``."""
        every = [p.replace("{model}", model) for p in self.reproduce.get(EVERY_MODEL, ())]
        return every + list(self.reproduce.get(model, ()))


def _names(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of names, got {value!r}")
    return tuple(value)


def load(name: str) -> Study:
    """The study ``configs/study/<name>.yaml``, its fields checked."""
    from omegaconf import OmegaConf

    path = STUDY_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"no study {name!r}: {path} does not exist; the studies are {names()}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    where = f"{path.relative_to(repo_root())}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping of {list(FIELDS)}")
    unknown = sorted(set(raw) - set(FIELDS))
    missing = [k for k in ("section", "command", "presets") if not raw.get(k)]
    if unknown or missing:
        raise ValueError(f"{where}: unknown fields {unknown}, missing {missing}; the fields are {list(FIELDS)}")
    presets = _names(raw["presets"], f"{where}: presets")
    borrowed = _names(raw.get("borrowed"), f"{where}: borrowed")
    if set(borrowed) - set(presets):
        raise ValueError(f"{where}: borrowed {sorted(set(borrowed) - set(presets))} are not among its presets")
    driver = raw.get("driver") or {}
    if set(driver) - set(DRIVER_FIELDS):
        raise ValueError(f"{where}: unknown driver options {sorted(set(driver) - set(DRIVER_FIELDS))}; the options "
                         f"are {list(DRIVER_FIELDS)}")
    reproduce = raw.get("reproduce") or {}
    return Study(name=name, section=str(raw["section"]), command=str(raw["command"]), preset_names=presets,
                 borrowed=borrowed, findings=raw.get("findings"),
                 driver=Driver(**{**driver, "slow": _names(driver.get("slow"), f"{where}: driver.slow")}),
                 reproduce={str(k): _names(v, f"{where}: reproduce.{k}") for k, v in reproduce.items()})


def names() -> list[str]:
    return sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))


@functools.cache
def studies() -> dict[str, Study]:
    """Every study, by name."""
    return {n: load(n) for n in names()}


def study(name: str) -> Study:
    got = studies()
    if name not in got:
        raise ValueError(f"unknown study {name!r}; one of {sorted(got)}")
    return got[name]


def pin_threads(threads: int | None) -> None:
    """Run this process again with ``OMP_NUM_THREADS=threads`` unless it is set so already (torch reads it once,
    when it loads, so a driver calls this first); None leaves torch's default."""
    if threads is not None and os.environ.get("OMP_NUM_THREADS") != str(threads):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "OMP_NUM_THREADS": str(threads)})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "reproduce":
        print("usage: python -m kvbench.sweep.studies_config reproduce STUDY MODEL", file=sys.stderr)
        return 2
    try:
        patterns = study(args[1]).reproduce_patterns(args[2])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(patterns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
