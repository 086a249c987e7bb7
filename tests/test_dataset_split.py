"""dataset.split: a development split for choosing hyperparameters whose windows come from documents no test
window or calibration window comes from."""


import pytest
from conftest import letter_corpus
from omegaconf import OmegaConf

from kvbench.inputs.capture import eval_windows, load_or_capture, trace_key
from kvbench.inputs.layout import ROLES, capture_windows, role_windows
from kvbench.store.results import cell_key


@pytest.fixture()
def corpus(tmp_path):
    """Twelve documents of distinct random letters: a window's text is found in exactly one of them."""
    return letter_corpus(tmp_path, 12)


def _documents(trace, docs, role):
    texts = ["".join(chr(int(t)) for t in s.kv.tokens) for s in trace.sequences if s.role == role]
    found = [[i for i, d in enumerate(docs) if t in d] for t in texts]
    assert all(len(f) == 1 for f in found)  # every window is a piece of one document
    return [f[0] for f in found]


def test_the_dev_split_scores_other_documents_with_the_same_calibration(tiny_cfg, tiny_handle, corpus):
    path, docs = corpus
    common = [f"dataset.path={path}", "dataset.seq_len=40", "dataset.eval_len=8", "dataset.n_sequences=3",
              "dataset.n_calib=2"]
    test = load_or_capture(tiny_cfg(*common), tiny_handle)
    dev_cfg = tiny_cfg(*common, "dataset.split=dev")
    dev = load_or_capture(dev_cfg, tiny_handle)
    assert trace_key(dev_cfg) != trace_key(tiny_cfg(*common))
    scored = set(_documents(test, docs, "eval")) | set(_documents(test, docs, "calib"))
    assert not set(_documents(dev, docs, "eval")) & scored
    assert _documents(dev, docs, "calib") == _documents(test, docs, "calib")  # fitted coders fit the same windows
    assert dev.manifest["dataset"]["split"] == "dev" and eval_windows(dev_cfg.dataset) == [1, 5, 9]
    # the interval resamples the documents the windows were cut from, as the capture recorded them
    for trace in (test, dev):
        assert trace.manifest["documents"] == _documents(trace, docs, "eval") + _documents(trace, docs, "calib")


@pytest.mark.parametrize("n,calib", [(1, 1), (4, 2), (16, 2), (3, 16)])
def test_no_window_serves_two_roles_and_a_larger_split_begins_with_the_smaller(n, calib):
    ds = OmegaConf.create({"n_sequences": n, "n_calib": calib})
    taken = {role: role_windows(role, 2 * n + calib) for role in ROLES}
    for a in ROLES:
        for b in ROLES:
            assert a == b or not set(taken[a]) & set(taken[b])
    for split in ("test", "dev"):
        evaluated, calibration = capture_windows(ds, split)
        assert evaluated == taken[split][:n] and calibration == taken["calib"][:calib]
        # the default four test windows are the first four of sixteen, the dev windows likewise
        bigger = capture_windows(OmegaConf.create({"n_sequences": 4 * n, "n_calib": calib}), split)[0]
        assert bigger[:n] == evaluated
        assert not set(bigger) & set(capture_windows(ds, "dev" if split == "test" else "test")[0])


def test_the_test_split_keeps_the_keys_it_had_and_a_bad_split_names_the_choices(tiny_cfg):
    cfg = tiny_cfg()
    as_before = OmegaConf.to_container(cfg, resolve=True)
    del as_before["dataset"]["split"]
    assert cell_key(OmegaConf.to_container(cfg, resolve=True)) == cell_key(as_before)
    assert cell_key(OmegaConf.to_container(tiny_cfg("dataset.split=dev"), resolve=True)) != cell_key(as_before)
    with pytest.raises(ValueError, match=r"dataset.split='val' is not allowed; choose one of \['test', 'dev'\]"):
        trace_key(tiny_cfg("dataset.split=val"))


def test_every_cell_of_the_selection_study_scores_the_dev_split_alone():
    from kvbench.report.sections import section
    from kvbench.sweep.presets import cells

    todo = cells(section("dev_split").presets, ["model=gemma3_270m"])
    assert len(todo) == 16 + 24 + 8 and all(c.cfg.dataset.split == "dev" for c in todo)


def test_the_dev_choice_is_the_lowest_nll_change_per_coder_and_budget_at_matched_rate():
    import pandas as pd

    from kvbench.report.sections.dev_split_section import dev_choice

    d = pd.DataFrame({"model": ["m"] * 5, "compressor": ["c"] * 5, "compressor_params.bits": [1, 1, 2, 2, 2],
                      "cfg.dataset.split": ["dev", "dev", "dev", "dev", "test"],
                      "delta_nll": [0.2, 0.1, 0.05, 0.07, 0.0], "nll_base": [1.0] * 5})
    got = dev_choice(d)
    assert len(got) == 4 and got["chosen"].tolist() == ["", "yes", "yes", ""]  # the test run is never a candidate
    # a candidate more than 5% above its group's lowest stream rate does not win by spending those bits
    d["stream_bits_per_element"] = [1.0, 1.2, 2.2, 2.09, 2.0]
    assert dev_choice(d)["chosen"].tolist() == ["yes", "", "", "yes"]


def test_the_dev_objective_weighs_the_recall_probes_relative_loss_beside_next_token_nll():
    import pandas as pd

    from kvbench.report.sections.dev_split_section import dev_choice

    # b loses 0.01 more next-token NLL (1% of base 1.0) but 0.05 less recall NLL (5% of base 1.0): b is chosen
    d = pd.DataFrame({"model": ["m"] * 2, "compressor": ["c"] * 2, "compressor_params.bits": [1, 1],
                      "cfg.dataset.split": ["dev"] * 2, "delta_nll": [0.01, 0.02], "nll_base": [1.0, 1.0],
                      "delta_nll_recall": [0.10, 0.05], "nll_recall_base": [1.0, 1.0]})
    got = dev_choice(d)
    assert got["chosen"].tolist() == ["", "yes"]
    assert got["dev_objective"].tolist() == pytest.approx([0.11, 0.07])
    # relative to each axis's base: the same recall losses over a base of 10 no longer outweigh the NLL difference
    d["nll_recall_base"] = [10.0, 10.0]
    assert dev_choice(d)["chosen"].tolist() == ["yes", ""]


def test_the_default_is_the_setting_with_the_lowest_nll_change_summed_over_the_budgets():
    import pandas as pd

    from kvbench.report.sections.dev_split_section import dev_choice

    # setting w=a wins at 1 bit by 0.02 and loses at 2 bits by 0.001: summed, it is the default
    d = pd.DataFrame({"model": ["m"] * 6, "compressor": ["c"] * 6, "compressor_params.bits": [1, 1, 2, 2, 2, 2],
                      "compressor_params.w": ["a", "b", "a", "b", "c", "a"],
                      "params": ["bits=1 w=a", "bits=1 w=b", "bits=2 w=a", "bits=2 w=b", "bits=2 w=c", "bits=2 w=a"],
                      "cfg.dataset.split": ["dev"] * 5 + ["test"],
                      "delta_nll": [0.05, 0.07, 0.004, 0.003, 0.0, 0.0], "nll_base": [1.0] * 6})
    got = dev_choice(d).set_index("params")
    assert got["chosen"].to_dict() == {"bits=1 w=a": "yes", "bits=1 w=b": "", "bits=2 w=a": "", "bits=2 w=b": "",
                                       "bits=2 w=c": "yes"}
    # w=c, measured at one budget only, is no default; the test run's lower NLL change does not count
    assert got["default"].to_dict() == {"bits=1 w=a": "yes", "bits=1 w=b": "", "bits=2 w=a": "yes", "bits=2 w=b": "",
                                        "bits=2 w=c": ""}
