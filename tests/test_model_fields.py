"""A user's own checkpoint (``model=hf``): named as itself wherever a run is named, loaded in the dtype and with the
attention ``model.dtype`` and ``model.attn_implementation`` ask for, both recorded in every summary, and neither
field moving the keys of runs and traces made before they existed."""

from __future__ import annotations

import json
import math
import shutil

import pandas as pd
import pytest
from omegaconf import OmegaConf

from kvbench.core.config import checkpoint_name, compose, make_compressor
from kvbench.inputs.capture import default_trace_dir, trace_key
from kvbench.sweep.cells import key_of


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))  # traces captured here


def _checkpoint(tmp_path, tiny_checkpoint, name: str, name_or_path: str | None = None):
    """The tiny checkpoint copied to ``tmp_path/name``, its config.json's ``_name_or_path`` set where given."""
    ckpt, _ = tiny_checkpoint
    out = tmp_path / name
    shutil.copytree(ckpt, out)
    if name_or_path is not None:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "_name_or_path": name_or_path}))
    return out


def _cell(tmp_path, tiny_checkpoint, ckpt, *overrides):
    _, corpus = tiny_checkpoint
    return compose(["model=hf", f"model.path={ckpt}", "dataset=text", f"dataset.path={corpus}", "dataset.seq_len=48",
                    "dataset.eval_len=8", "dataset.n_sequences=2", "dataset.n_calib=1",
                    f"paths.results={tmp_path / 'results'}", *overrides])


# ---------------------------------------------------------------------------------------------- the name


@pytest.mark.parametrize(("name_or_path", "named"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),  # a hub id names the model
    ("my-finetune", "my-finetune"),
    ("/scratch/u/run7/checkpoint-500", "mine"),  # where it was saved from says nothing: the folder's own name
    ("./out", "mine"),
    ("", "mine"),
    (None, "mine"),  # transformers 5 writes no _name_or_path
])
def test_a_checkpoint_is_named_by_its_config_or_its_folder(tmp_path, name_or_path, named):
    (tmp_path / "mine").mkdir()
    cfg = {} if name_or_path is None else {"_name_or_path": name_or_path}
    (tmp_path / "mine" / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_name(tmp_path / "mine") == named


def test_a_hugging_face_cache_snapshot_is_named_by_its_model_id(tmp_path):
    snap = tmp_path / "models--org--Some-Model-1B" / "snapshots" / "3f2a9c"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert checkpoint_name(snap) == "org/Some-Model-1B"


def test_model_hf_takes_the_checkpoints_name_unless_one_is_set(tmp_path):
    (tmp_path / "my-llama").mkdir()
    assert compose(["model=hf", f"model.path={tmp_path / 'my-llama'}"]).model.name == "my-llama"
    assert compose(["model=hf", f"model.path={tmp_path / 'my-llama'}", "model.name=llama-v2"]).model.name == "llama-v2"
    assert compose(["model=smollm2_135m"]).model.name == "smollm2_135m"


def test_a_hub_id_name_makes_one_trace_folder(tmp_path, tiny_checkpoint):
    ckpt = _checkpoint(tmp_path, tiny_checkpoint, "c", "org/tiny-model")
    cfg = _cell(tmp_path, tiny_checkpoint, ckpt)
    assert cfg.model.name == "org/tiny-model"
    assert default_trace_dir(cfg).name.startswith("org--tiny-model-text-")


def test_two_checkpoints_in_one_results_root_are_two_named_rows_of_the_report(tmp_path, tiny_checkpoint, capsys):
    from kvbench.__main__ import main
    from kvbench.sweep.cells import run_cell

    one = _checkpoint(tmp_path, tiny_checkpoint, "tiny-one")
    two = _checkpoint(tmp_path, tiny_checkpoint, "tiny-two", "org/tiny-two-instruct")
    for ckpt in (one, two):
        out = run_cell("run", _cell(tmp_path, tiny_checkpoint, ckpt, "+compressor=kivi", "compressor.residual=0",
                                    "metrics.nll=false"))
        assert out.summary["model"] == out.summary["config"]["model"]["name"]
        assert default_trace_dir(_cell(tmp_path, tiny_checkpoint, ckpt)).exists()
    assert main(["report", str(tmp_path / "results" / "runs"), "--out", str(tmp_path / "report")]) == 0
    table = pd.read_csv(tmp_path / "report" / "runs.csv")
    assert sorted(table["model"]) == ["org/tiny-two-instruct", "tiny-one"]
    md = (tmp_path / "report" / "runs.md").read_text()
    assert "| tiny-one " in md and "| org/tiny-two-instruct " in md


# ---------------------------------------------------------------------------------------------- dtype and attention


def test_model_dtype_is_by_device_unless_set():
    assert compose([]).model.dtype == "float32"
    assert compose(["device=cuda"]).model.dtype == "bfloat16"
    assert compose(["device=cuda", "model.dtype=float32"]).model.dtype == "float32"
    assert compose([]).model.attn_implementation == "sdpa"


@pytest.mark.parametrize(("overrides", "dtype", "attn"), [
    (["+compressor=kivi", "compressor.residual=0"], "bfloat16", "sdpa"),  # codes every token; scored in bfloat16
    (["+compressor=snapkv", "compressor.keep=0.5", "compressor.window=8"], "bfloat16", "sdpa"),  # queries recaptured
    (["+compressor=recompute"], "bfloat16", "sdpa"),  # the decoder runs the model itself
    (["+compressor=kivi", "compressor.residual=0"], "float16", "eager"),
], ids=["kivi-bfloat16", "snapkv-bfloat16", "recompute-bfloat16", "kivi-float16-eager"])
def test_a_model_loaded_in_its_own_dtype_runs_end_to_end_on_the_cpu(tmp_path, tiny_checkpoint, overrides, dtype, attn):
    """``python -m kvbench run +compressor=kivi model.dtype=bfloat16`` on the tiny checkpoint: capture, coding and
    scoring run with the model as loaded, and the summary says how it was loaded, apart from the cache dtype."""
    import torch

    from kvbench.inputs.models import ModelHandle
    from kvbench.measure.run import measure

    ckpt, _ = tiny_checkpoint
    cfg = _cell(tmp_path, tiny_checkpoint, ckpt, *overrides, f"model.dtype={dtype}",
                f"model.attn_implementation={attn}")
    handle = ModelHandle(cfg.model, cfg.device)
    summary, _ = measure(cfg, make_compressor(cfg.compressor), handle)
    assert next(handle.model.parameters()).dtype == getattr(torch, dtype)
    assert handle.model.config._attn_implementation == attn
    assert (summary["model_dtype"], summary["attn_implementation"], summary["dtype"]) == (dtype, attn, "float16")
    assert math.isfinite(summary["delta_nll"]) and summary["eval_tokens"] > 0
    assert json.loads((default_trace_dir(cfg) / "manifest.json").read_text())["model_dtype"] == dtype


def test_a_run_records_the_models_dtype_and_attention_also_when_it_never_loads_it(tiny_cfg, tiny_handle):
    from kvbench.inputs.capture import load_or_capture
    from kvbench.measure.run import measure

    trace = load_or_capture(tiny_cfg(), tiny_handle)
    cfg = tiny_cfg("+compressor=identity", f"trace={trace.path}", "metrics.nll=false")

    class Unloaded:  # a run on a stored trace without NLL reads no weights
        cfg = config = None
        loaded = False

        @property
        def model(self):
            raise AssertionError("the model was loaded although the trace and metrics did not need it")

    summary, _ = measure(cfg, make_compressor(cfg.compressor), Unloaded())
    assert (summary["model_dtype"], summary["attn_implementation"]) == ("float32", "sdpa")
    with pytest.raises(ValueError, match=r"captured by the model in float32 but model\.dtype=bfloat16 was asked for"):
        measure(tiny_cfg("+compressor=identity", f"trace={trace.path}", "model.dtype=bfloat16"),
                make_compressor(cfg.compressor), Unloaded())


def test_the_model_dtype_and_attention_key_traces_and_cells_only_away_from_float32_and_sdpa(tiny_cfg):
    default = tiny_cfg("+compressor=kivi")
    # a config of before these fields (as committed evidence and cached traces were made) keys as the default
    before = OmegaConf.create(OmegaConf.to_container(default))
    del before.model["dtype"], before.model["attn_implementation"]
    assert trace_key(before) == trace_key(default) == trace_key(tiny_cfg("model.dtype=float32"))
    assert key_of(before) == key_of(default) == key_of(tiny_cfg("+compressor=kivi", "model.dtype=float32"))
    for moved in ("model.dtype=bfloat16", "model.dtype=float16", "model.attn_implementation=eager"):
        assert trace_key(tiny_cfg(moved)) != trace_key(default), moved
        assert key_of(tiny_cfg("+compressor=kivi", moved)) != key_of(default), moved
