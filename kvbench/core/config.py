"""Config plumbing: composing run configs and turning the ``compressor`` node into an object."""

from __future__ import annotations

import dataclasses
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
    """The config as ``python -m kvbench run OVERRIDES`` (or ``eval``/``latency`` by ``config_name``) would see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="kvbench"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))
