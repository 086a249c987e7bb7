"""Config plumbing: composing run configs, resolving the model fields a config leaves to its checkpoint or device, and
turning the ``compressor`` node into an object."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from kvbench.core.compressor import Compressor
from kvbench.store.paths import repo_root

CONFIG_DIR = repo_root() / "configs"


def available(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def compressor_class(name: str) -> type[Compressor]:
    """The class ``configs/compressor/<name>.yaml`` selects (its ``_target_``), without instantiating it."""
    import hydra.utils
    from omegaconf import OmegaConf

    return hydra.utils.get_class(OmegaConf.load(CONFIG_DIR / "compressor" / f"{name}.yaml")["_target_"])


def instantiate_plugin(node: Any, base: type, group: str, kind: str) -> Any:
    """Instantiate a config node selected by ``_target_`` as a dataclass subclass of ``base``, with errors that
    name the available choices of ``group`` and the fields of the chosen class."""
    import hydra.utils
    from omegaconf import OmegaConf

    spec = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    target = spec.get("_target_")
    if not target:
        raise ValueError(f"no {kind} chosen; available: {available(group)}")
    cls = hydra.utils.get_class(target)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{kind} _target_ {target} is not a kvbench {base.__name__}")
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    unknown = sorted(set(spec) - fields - {"_target_"})
    if unknown:
        raise ValueError(f"{kind} {cls.name!r} has no field(s) {unknown}; its fields are {sorted(fields)}")
    try:
        return hydra.utils.instantiate(spec, _convert_="all")
    except Exception as e:  # hydra wraps the ValueError from __post_init__; surface the original message
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise ValueError(str(cause)) from e


def make_compressor(node: Any) -> Compressor:
    """Instantiate a compressor config node (selected by ``_target_``), with errors that say what is allowed."""
    if node is None:
        raise ValueError(f"no compressor chosen: add +compressor=NAME with NAME one of {available('compressor')}")
    return instantiate_plugin(node, Compressor, "compressor", "compressor")


def compose(overrides: list[str] | None = None, config_name: str = "run") -> Any:
    """The config as ``python -m kvbench run OVERRIDES`` (or ``eval``/``latency`` by ``config_name``) would see it,
    its model fields resolved (:func:`resolve_model`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="kvbench"):
        return resolve_model(hydra_compose(config_name=config_name, overrides=list(overrides or [])))


# ---------------------------------------------------------------------------------------------- the model's fields

#: hub ids (``org/name`` or ``name``): what a checkpoint's ``_name_or_path`` holds when it names a model rather
#: than the folder the checkpoint was saved from (an absolute or ``./`` path says nothing of the model)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def checkpoint_name(path: str | os.PathLike) -> str:
    """The name a local checkpoint directory goes by: its config.json's ``_name_or_path`` when that is a hub id,
    else the directory's own name (in a Hugging Face cache snapshot, ``models--org--name/snapshots/<hash>``, the
    model's id, not the hash). Symlinks are not followed: a link named for the model names it."""
    folder = Path(os.path.abspath(os.path.expanduser(str(path))))
    try:
        named = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        named = None
    if isinstance(named, str) and _HUB_ID.fullmatch(named):
        return named
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.removeprefix("models--").replace("--", "/")
    return folder.name


def default_model_dtype(device: str) -> str:
    """``model.dtype: null``: float32 on a CPU (where 16-bit arithmetic is emulated, and slower), bfloat16 on a GPU."""
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def resolve_model(cfg: Any) -> Any:
    """``cfg`` (a composed config, changed in place and returned) with the model fields it leaves open filled in, so
    that summaries, cell keys, trace names and report rows all read one value: ``model.name: null`` (``model=hf``)
    becomes the checkpoint's name (:func:`checkpoint_name`; left null while ``model.path`` is not given, for the
    config check to name), ``model.dtype: null`` the device's default (:func:`default_model_dtype`)."""
    from omegaconf import OmegaConf, open_dict

    model = cfg.get("model") if hasattr(cfg, "get") else None
    if model is None or not OmegaConf.is_config(model):
        return cfg
    with open_dict(model):
        path = OmegaConf.select(model, "path", default=None, throw_on_missing=False)
        if model.get("name") is None and path not in (None, "") and not OmegaConf.is_missing(model, "path"):
            model.name = checkpoint_name(path)
        if model.get("dtype") is None:
            model.dtype = default_model_dtype(str(cfg.get("device", "cpu")))
    return cfg
