"""The Hydra configs as the commands compose them: what the measuring commands share comes from configs/base.yaml and
the compressed cache's knobs from the ``cache`` group, and neither move changed a resolved config or a cell key (the
keys pinned here are those runs were filed under before); every option of every config group composes for the
commands that take it, and what it selects builds. A study is a config (configs/study/): every preset belongs to
exactly one, each study's presets compose and build, and the cells reproduce.sh takes of it are cells of it."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from kvbench.core.config import CONFIG_DIR, available, compose
from kvbench.sweep.cells import key_of
from kvbench.sweep.commands import MEASURING
from kvbench.sweep.presets import Preset, cells

COMMANDS = sorted(MEASURING)  # eval, latency, restore, run
# what every measuring command takes from configs/base.yaml
SHARED = {"dtype": "float16", "device": "cpu", "seed": 0, "trace": None, "capture": {"pre_rope": False},
          "paths": {"results": "results", "prefills": "auto"}}
CACHE = {"residual": 0, "chunk": 128, "mode": "auto"}


@pytest.fixture(autouse=True)
def _default_results(monkeypatch):
    monkeypatch.delenv("KVBENCH_RESULTS", raising=False)


def resolved(kind: str, *overrides: str) -> dict:
    return OmegaConf.to_container(compose(list(overrides), config_name=kind), resolve=True)


@pytest.mark.parametrize("kind", COMMANDS)
def test_every_command_takes_the_shared_fields_from_the_base_and_lists_only_its_own(kind):
    cfg = resolved(kind, "+compressor=kivi")
    assert {k: cfg[k] for k in SHARED} == SHARED
    assert cfg["model"]["name"] == "smollm2_135m" and cfg["dataset"]["name"] == "sotu"
    assert cfg["metrics"]["resume"] == ("code" if kind in ("run", "eval") else False)  # timing is never reused
    own = OmegaConf.load(CONFIG_DIR / f"{kind}.yaml")
    assert not set(own) & set(SHARED), f"{kind}.yaml repeats fields of base.yaml"
    assert list(own.defaults)[0] == "base"
    # a command line override of a shared field reaches every command alike
    moved = resolved(kind, "+compressor=kivi", "model=gemma3_270m", "dtype=bfloat16", "seed=3", "paths.results=/r")
    assert (moved["model"]["name"], moved["dtype"], moved["seed"], moved["paths"]["results"]) == (
        "gemma3_270m", "bfloat16", 3, "/r")


def test_eval_and_latency_share_the_cache_group_each_with_its_own_window():
    assert resolved("eval")["cache"] == CACHE  # the whole context coded: the compressor's own rate
    latency = resolved("latency", "cache.chunk=64")
    assert latency["cache"] == {**CACHE, "residual": 128, "chunk": 64}  # KIVI's window for every compressor
    assert not {"residual", "chunk", "mode"} & set(latency["latency"]), "the cache knobs are cache.*"
    assert "cache" not in resolved("restore") and "cache" not in resolved("run")
    assert OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "cache" / "default.yaml")) == CACHE


def test_cell_keys_are_those_runs_were_filed_under():
    """Keys of runs made before the shared base and the cache group: a change here orphans every finished run."""
    assert {kind: key_of(compose(["+compressor=kivi"], config_name=kind)) for kind in COMMANDS} == {
        "run": "0a9fd895b907", "eval": "b9bddbf55db5", "restore": "fa925c07a4e0",
        "latency": "2e8bce68c0ce", "stepcost": "89e529475a46"}  # latency's moved with latency.residual/chunk/mode -> cache.*;
    # eval's with its default tasks (RULER's generator instead of BIG-bench, which the registry no longer serves): the
    # default eval measures other tasks, so its runs are other cells; the presets name their tasks and keep their keys
    got = {c.overrides: c.key for c in cells([Preset("run", "per_vector_kivi"), Preset("eval", "ruler_eviction")])}
    assert got[("+compressor=kivi", "compressor.residual=0", "compressor.bits=2", "+experiment=per_vector_kivi")] == (
        "c1fd3e47505e")
    # SnapKV's moved with its default pooling (max -> the reference's average): runs at max pooling are other cells
    assert got[("+compressor=snapkv", "compressor.keep=0.5", "+experiment=ruler_eviction")] == "31933309a5ea"
    assert key_of(compose(["+compressor=kivi", "cache.residual=128"], config_name="eval")) != "b9bddbf55db5"


# config group -> the commands that take it (compressor as +compressor=NAME); experiment: tests/test_scripts.py
GROUPS = {"model": COMMANDS, "dataset": COMMANDS, "compressor": ["run"], "workload": ["run"],
          "cache": ["eval", "latency"]}
NOT_COMMAND_GROUPS = {"experiment", "hydra", "study"}  # presets and studies: below


def test_every_config_group_is_composed_here():
    groups = {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()}
    assert groups - NOT_COMMAND_GROUPS == set(GROUPS)


@pytest.mark.parametrize("group,option,kind", [(g, o, k) for g, kinds in GROUPS.items() for o in available(g)
                                               for k in kinds])
def test_every_option_of_every_group_composes_and_builds_what_it_selects(group, option, kind):
    from kvbench.core.config import make_compressor
    from kvbench.inputs.workloads import make_workload, selected

    cfg = compose([f"{'+' if group == 'compressor' else ''}{group}={option}"], config_name=kind)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    node = cfg[group]
    if group == "compressor":
        assert type(make_compressor(node)).__name__.lower() == option.replace("_", "")
    elif group == "workload":
        assert selected(node) == (option != "none")
        if selected(node):
            assert make_workload(node).name == option
    elif group in ("model", "dataset"):
        # a checkpoint (model=hf) is named as itself once model.path says which one
        assert node.name == (None if (group, option) == ("model", "hf") else option)


MODELS = ("smollm2_135m", "gemma3_270m")


def test_every_preset_belongs_to_exactly_one_study_and_a_borrowed_one_to_another():
    from kvbench.sweep.studies_config import studies

    owners: dict[str, list[str]] = {}
    for s in studies().values():
        for name in s.owned:
            owners.setdefault(name, []).append(s.name)
    assert {n: o for n, o in owners.items() if len(o) > 1} == {}, "a preset owned by two studies"
    assert sorted(owners) == available("experiment"), "a preset of no study: join the study it serves, or go"
    for s in studies().values():
        assert all(owners[b] != [s.name] for b in s.borrowed), s.name


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONFIG_DIR / "study").glob("*.yaml")))
def test_every_study_names_its_section_command_findings_and_driver_and_its_presets_build(name):
    from kvbench.core.config import make_compressor
    from kvbench.inputs.workloads import make_workload, selected
    from kvbench.report.sections import SECTIONS
    from kvbench.store.paths import repo_root
    from kvbench.sweep.presets import cell_overrides
    from kvbench.sweep.studies_config import study

    s = study(name)
    assert s.section in SECTIONS and SECTIONS[s.section].presets == s.presets
    assert s.command in MEASURING
    assert s.findings is None or (repo_root() / "results" / s.findings).is_file()
    driver = [p for p in (repo_root() / "scripts").glob("*.py") if f'study("{name}").options()' in p.read_text()]
    assert len(driver) == 1, f"one script in scripts/ drives {name} with its options"
    for preset in s.presets:  # the first cell of each preset, as its driver composes it
        cfg = compose(cell_overrides(preset)[0], config_name=s.command)
        make_compressor(cfg.compressor)
        if selected(cfg.get("workload")):
            make_workload(cfg.workload)


def test_the_cells_reproduce_takes_of_a_study_are_its_cells_one_a_pattern():
    from kvbench.studies import matching
    from kvbench.sweep.studies_config import studies

    taken = {}
    for s in (s for s in studies().values() if s.reproduce):
        assert set(s.reproduce) <= {"every_model", *MODELS}, s.name
        every = cells(s.presets)
        for m in MODELS:
            # presets with a model axis name the model in the pattern, the others take it as an override
            named = any("{model}" in p for p in s.reproduce.get("every_model", ()))
            todo = every if named else cells(s.presets, [f"model={m}"])
            for pattern in s.reproduce_patterns(m):
                (cell,) = matching(todo, [pattern])
                assert cell.cfg.model.name == m, pattern
                taken[(s.name, m, pattern)] = cell.key
    # 15 frontier cells on SmolLM2 (KVTC without its window and waterfill at 1.25 bits there alone), 12 on gemma; 4
    # eviction and 3 RULER cells on each; the frontier's RULER axis: each coder's best point and FP8 (10 on SmolLM2,
    # with KVTC with and without its window and StreamingLLM, 8 on gemma)
    per = {(st, m): sum(1 for k in taken if k[:2] == (st, m)) for st, m, _ in taken}
    assert per == {("frontier", "smollm2_135m"): 15, ("frontier", "gemma3_270m"): 12, ("eviction", "smollm2_135m"): 4,
                   ("eviction", "gemma3_270m"): 4, ("ruler", "smollm2_135m"): 3, ("ruler", "gemma3_270m"): 3,
                   ("frontier_ruler", "smollm2_135m"): 10, ("frontier_ruler", "gemma3_270m"): 8}
    assert len(set(taken.values())) == len(taken)
