"""A model's geometry, read from its config: what its KV cache and weights take in memory, for
``python -m kvbench capacity``. Nothing is loaded.

Three kinds of model config give it:

- a geometry-only config (``source: geometry``, e.g. ``configs/model/llama31_8b.yaml``): its ``geometry`` node,
  written from the model's published config.json. No weights are packaged, so every command that runs the model
  refuses it (:func:`refusal`);
- a packaged model: the geometry on its row of :data:`kvbench.inputs.assets.MODELS`;
- a checkpoint (``model=hf model.path=DIR``): its ``config.json`` (the text config of a multimodal one); it gives
  no parameter count, so ``capacity.weights_gb`` must say what the weights take.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbench.inputs.assets import MODELS, Geometry

#: ``model.source`` of a config that describes a model's shape and has no weights
GEOMETRY_ONLY = "geometry"
#: the fields of a geometry-only config's ``geometry`` node (``native_positions`` may be left out)
FIELDS = ("n_layers", "n_kv_heads", "head_dim", "params", "max_positions")


def _get(node: Any, key: str, default: Any = None) -> Any:
    """``node.key``; ``default`` where it is absent or left ``???`` (model=hf's path)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(node) and (key not in node or OmegaConf.is_missing(node, key)):
        return default
    return node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)


def refusal(model_cfg: Any) -> str:
    """What a command that runs the model says of a geometry-only config."""
    name = _get(model_cfg, "name")
    return (f"model={name} is geometry only (layers, KV heads, head_dim and parameter count for python -m kvbench "
            f"capacity; no weights are packaged): run your own checkpoint with model=hf model.path=DIR")


def _count(owner: str, field: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < least:
        raise ValueError(f"{owner}.{field}={value!r} must be a whole number of at least {least}")
    return int(value)


def from_node(node: Any, owner: str = "model.geometry") -> Geometry:
    """A geometry-only config's ``geometry`` node as a :class:`Geometry`; a missing or bad field is a ValueError
    naming it."""
    if node is None:
        raise ValueError(f"{owner} is not set; a config with model.source={GEOMETRY_ONLY} gives {list(FIELDS)}")
    missing = [f for f in FIELDS if _get(node, f) is None]
    if missing:
        raise ValueError(f"{owner} lacks {missing}; it gives {list(FIELDS)}")
    native = _get(node, "native_positions")
    return Geometry(*(_count(owner, f, _get(node, f)) for f in FIELDS),
                    native_positions=None if native is None else _count(owner, "native_positions", native),
                    note=str(_get(node, "note") or ""))


def from_checkpoint(path: str | Path) -> Geometry:
    """A checkpoint's geometry from its ``config.json`` (no parameter count: the config has none)."""
    f = Path(str(path)).expanduser() / "config.json"
    if not f.is_file():
        raise ValueError(f"model.path={path} is not a Hugging Face checkpoint directory (no config.json)")
    c = json.loads(f.read_text())
    c = c.get("text_config") or c
    heads = c.get("num_attention_heads")
    try:
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        return Geometry(int(c["num_hidden_layers"]), int(c.get("num_key_value_heads") or heads), int(head_dim), None,
                        int(c["max_position_embeddings"]))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{f} does not give the model's layers, KV heads and head_dim ({type(e).__name__}: {e})") from e


def geometry_of(model_cfg: Any) -> Geometry:
    """The geometry of the model ``model_cfg`` names (see the module docstring); an unknown model is a ValueError
    naming ``model.name`` and the models that have one."""
    source, name = _get(model_cfg, "source"), _get(model_cfg, "name")
    if source == GEOMETRY_ONLY:
        return from_node(_get(model_cfg, "geometry"))
    if source == "hf":
        path = _get(model_cfg, "path")
        if path in (None, ""):
            raise ValueError("model.path is not set; model=hf reads a local Hugging Face checkpoint directory: "
                             "model=hf model.path=DIR")
        return from_checkpoint(path)
    if source == "packaged" and name in MODELS and MODELS[name].geometry is not None:
        return MODELS[name].geometry
    from kvbench.core.config import available

    raise ValueError(f"model.name={name!r} (model.source={source!r}) has no geometry; choose model= one of "
                     f"{[m for m in available('model') if m != 'hf']} (packaged, or geometry only), or model=hf "
                     "model.path=DIR")
