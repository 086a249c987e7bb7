"""Which runs a study section shows: the runs whose summaries carry the ``cell_key`` of one of its presets' cells, on
any packaged model; each cell composed and keyed once, and a preset moved only to models its cells do not run on."""

import pandas as pd

from kvbench.report.collect import Collection
from kvbench.report.sections import SECTIONS, select
from kvbench.sweep.presets import Preset, cell_keys, cells, other_models

RULER = Preset("eval", "ruler")  # no model axis
FRONTIER_KIVI = Preset("run", "frontier_kivi")  # a model axis: smollm2_135m, gemma3_270m


def test_cell_keys_are_the_keys_of_the_cells_and_none_for_a_preset_the_overrides_do_not_fit():
    turboquant, kivi = SECTIONS["per_vector"].presets
    assert cell_keys(kivi) == [c.key for c in cells([kivi])]
    mse = ["compressor.variant=mse", "compressor.bits=3"]
    assert cell_keys(turboquant, mse) == [c.key for c in cells([turboquant], mse)] and len(cell_keys(turboquant, mse)) == 1
    assert cell_keys(kivi, mse) == []


def test_a_preset_is_moved_only_to_the_models_its_cells_do_not_run_on():
    assert other_models(RULER, ["gemma3_270m", "smollm2_135m"]) == ["gemma3_270m"]
    assert other_models(FRONTIER_KIVI, ["gemma3_270m", "hf", "smollm2_135m"]) == ["hf"]
    # the overrides left out add no cell: the model a preset runs on, or a value of its model axis
    assert cell_keys(RULER, ["model=smollm2_135m"]) == cell_keys(RULER)
    assert set(cell_keys(FRONTIER_KIVI, ["model=gemma3_270m"])) < set(cell_keys(FRONTIER_KIVI))
    assert set(cell_keys(RULER, ["model=gemma3_270m"])).isdisjoint(cell_keys(RULER))


def test_a_section_shows_the_runs_of_every_cell_on_every_model_in_preset_order_and_nothing_else():
    presets = (RULER, FRONTIER_KIVI)
    every: dict[tuple[str, str], str] = {}  # every cell on every model, in order: the preset composed per model
    for p in presets:
        for extra in ([], ["model=gemma3_270m"], ["model=smollm2_135m"]):
            for c in cells([p], extra):
                every.setdefault((c.kind, c.key), p.name)
    assert len(every) == 2 * 2 + 4
    rows = {kind: [{"cell_key": key, "run_id": f"{name}-{i}", "model": "smollm2_135m"}
                   for i, ((k, key), name) in reversed(list(enumerate(every.items()))) if k == kind]
            for kind in ("run", "eval")}
    rows["eval"].append({"cell_key": "decoy", "run_id": "decoy", "model": "gemma3_270m"})
    got = select(Collection(table=pd.DataFrame(rows["run"]), evals=pd.DataFrame(rows["eval"])), presets)
    shown = [(k, key) for k, df in (("eval", got.evals), ("run", got.table)) for key in df["cell_key"]]
    assert shown == list(every)
    assert list(got.evals["preset"]) == ["ruler"] * 4 and list(got.table["preset"]) == ["frontier_kivi"] * 4
