"""The Hydra configs as the commands compose them: what the measuring commands share comes from configs/base.yaml and
the compressed cache's knobs from the ``cache`` group, and neither move changed a resolved config or a cell key (the
keys pinned here are those runs were filed under before); every option of every config group composes for the
commands that take it, and what it selects builds."""

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
          "paths": {"results": "results"}}
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
        "run": "0a9fd895b907", "eval": "3a21310505ee", "restore": "fa925c07a4e0",
        "latency": "2e8bce68c0ce"}  # latency's moved with latency.residual/chunk/mode -> cache.*
    got = {c.overrides: c.key for c in cells([Preset("run", "per_vector_kivi"), Preset("eval", "ruler_eviction")])}
    assert got[("+compressor=kivi", "compressor.residual=0", "compressor.bits=2", "+experiment=per_vector_kivi")] == (
        "c1fd3e47505e")
    assert got[("+compressor=snapkv", "compressor.keep=0.5", "+experiment=ruler_eviction")] == "fc3b0f6c75bd"
    assert key_of(compose(["+compressor=kivi", "cache.residual=128"], config_name="eval")) != "3a21310505ee"


# config group -> the commands that take it (compressor as +compressor=NAME); experiment: tests/test_scripts.py
GROUPS = {"model": COMMANDS, "dataset": COMMANDS, "compressor": ["run"], "workload": ["run"],
          "cache": ["eval", "latency"]}
NOT_COMMAND_GROUPS = {"experiment", "hydra"}


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
        assert node.name == option
