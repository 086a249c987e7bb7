"""Every fitted coder's defaults are the settings the development split chose: for each registered compressor that
fits codec state, the fields it declares ``tuned`` were swept (two values at least) in the committed evidence of study
``dev_split`` on the default model, and its config's default for each is the value of the setting the study's rule
chose as that coder's default (:func:`kvbench.report.sections.dev_split_section.dev_choice`). A default edited by
hand, or a new tuned field nobody swept, fails here."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.core.compressor import Compressor
from kvbench.core.config import available, compressor_class
from kvbench.report.collect import plain
from kvbench.report.evidence import load
from kvbench.report.sections.defaults_section import default_model
from kvbench.report.sections.dev_split_section import dev_choice

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "compressor"


def _classes() -> dict[str, type]:
    return {name: compressor_class(name) for name in available("compressor")}


def _fitted() -> dict[str, type]:
    """The registered compressors that fit codec state of their own (wrappers around another coder excepted)."""
    return {n: c for n, c in _classes().items()
            if c.state is not Compressor.state and c.family not in ("eviction", "dedup")}


def test_every_fitted_coder_declares_which_fields_the_development_split_chooses():
    fitted = _fitted()
    assert {"kvtc", "waterfill", "aquakv", "kvquant", "delta"} <= set(fitted)
    for cls in fitted.values():
        assert "tuned" in vars(cls), f"{cls.__name__} fits codec state: declare tuned (the fields dev_split chooses)"
        fields = set(cls.__dataclass_fields__)
        assert set(cls.tuned) <= fields, f"{cls.__name__}.tuned names no field: {sorted(set(cls.tuned) - fields)}"


@pytest.fixture(scope="module")
def chosen():
    d = dev_choice(load("dev_split", ROOT / "results").got.table)
    return d[d["model"].astype(str) == default_model()]


@pytest.mark.parametrize("name", sorted(n for n, c in _fitted().items() if c.tuned))
def test_each_tuned_default_is_the_setting_the_committed_dev_evidence_chose(name, chosen):
    cls, cfg = _classes()[name], OmegaConf.load(CONFIGS / f"{name}.yaml")
    runs = chosen[chosen["compressor"].astype(str) == name]
    assert not runs.empty, f"no dev_split run of {name} on {default_model()}: run python scripts/dev_split.py"
    picked = runs[runs["default"] == "yes"]
    assert not picked.empty, f"the dev_split rule chose no default for {name}"
    for field in cls.tuned:
        col = f"compressor_params.{field}"
        swept = {plain(v) for v in runs[col]}
        assert len(swept) >= 2, f"{name}.{field} was not swept on dev (only {sorted(swept)})"
        want = {plain(v) for v in picked[col]}
        assert want == {plain(cfg[field])}, \
            f"configs/compressor/{name}.yaml: {field}={cfg[field]!r}, but the dev evidence chose {sorted(want)}"
