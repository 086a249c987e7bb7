"""Loading the model that produces (and, for some compressors, regenerates) the KV cache."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbench.core.config import default_model_dtype
from kvbench.inputs.assets import MODELS, AssetError, ensure_model

#: ``model.dtype``: what the weights are loaded in (the cache's own dtype is the run's ``dtype``)
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``model.attn_implementation``: the attention kernels transformers runs. Methods that need attention weights
#: recompute them from captured queries (compressors/eviction/query_attention.py), so none needs ``eager``.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
#: transformers' default, which every run before the field existed used
DEFAULT_ATTN = "sdpa"


@dataclass
class ModelInfo:
    """The model facts a trace records and a decoder may rely on."""

    name: str
    source: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_types: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


def check_model_cfg(model_cfg: Any) -> None:
    """Refuse a model config that would load something else than it names, each with a one-line error naming the
    field, its value and what is allowed: a ``model.path`` given with a packaged model (the packaged weights would be
    loaded, the path ignored, and the summary's config would still name the path as if it had been read), a
    checkpoint without one, an empty name, an unknown source, packaged model, weight dtype or attention
    implementation; and a geometry-only config (``source: geometry``: a shape for ``python -m kvbench capacity``, no
    weights), with how to run one's own checkpoint instead."""
    from omegaconf import OmegaConf

    from kvbench.core.checks import check_choice
    from kvbench.inputs.geometry import GEOMETRY_ONLY, refusal

    missing = OmegaConf.is_config(model_cfg) and OmegaConf.is_missing(model_cfg, "path")  # model=hf's ???
    path = None if missing else _get(model_cfg, "path")
    source, name = _get(model_cfg, "source"), _get(model_cfg, "name")
    if source == GEOMETRY_ONLY:
        raise ValueError(refusal(model_cfg))
    if source is not None:  # a config naming a model built in the process (tests) has none
        check_choice("model", "source", source, ["packaged", "hf"])
    if source == "packaged" and path not in (None, ""):
        raise ValueError(f"model.path={path} is only read with model=hf (a local Hugging Face checkpoint directory); "
                         f"model={name or '?'} is packaged and loads its own weights (packaged models: "
                         f"{sorted(MODELS)}): drop model.path, or use model=hf model.path={path}")
    if source == "packaged" and name not in MODELS:
        raise ValueError(f"model.name={name!r} is not a packaged model; choose one of {sorted(MODELS)}, or use "
                         "model=hf model.path=DIR for a local checkpoint")
    if source == "hf" and path in (None, ""):
        raise ValueError("model.path is not set; model=hf reads a local Hugging Face checkpoint directory: "
                         "model=hf model.path=DIR")
    if name is not None and not str(name).strip():
        raise ValueError(f"model.name={name!r} is empty; leave it unset (model=hf: the checkpoint's own name) or name "
                         "the model")
    if _get(model_cfg, "dtype") is not None:  # null: by device
        check_choice("model", "dtype", _get(model_cfg, "dtype"), MODEL_DTYPES)
    check_choice("model", "attn_implementation", attn_implementation(model_cfg), ATTN_IMPLEMENTATIONS)


def resolve_model_dir(model_cfg: Any) -> Path:
    check_model_cfg(model_cfg)
    if model_cfg.source == "packaged":
        return ensure_model(model_cfg.name)
    path = Path(str(model_cfg.path)).expanduser()  # model=hf: check_model_cfg allows no other source
    if not (path / "config.json").exists():
        raise AssetError(f"model.path={path} is not a Hugging Face checkpoint directory (no config.json)")
    return path


def describe(model: Any, name: str, source: str, meta: dict | None = None) -> ModelInfo:
    c = model.config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    return ModelInfo(name, source, c.num_hidden_layers, c.num_attention_heads, n_kv, head_dim, c.vocab_size, types, meta or {})


def _get(model_cfg: Any, key: str, default: Any = None) -> Any:
    return model_cfg.get(key, default) if hasattr(model_cfg, "get") else getattr(model_cfg, key, default)


def model_dtype_name(model_cfg: Any, device: str = "cpu") -> str:
    """``model.dtype``, or the device's default where the config leaves it null (or has no such field)."""
    return str(_get(model_cfg, "dtype") or default_model_dtype(device))


def attn_implementation(model_cfg: Any) -> str:
    return str(_get(model_cfg, "attn_implementation") or DEFAULT_ATTN)


def model_identity(handle: Any) -> tuple | None:
    """The model's name and path as the run's config gives them, and its dtype and attention where they are not the
    float32 and sdpa every earlier run had (so their stored baselines keep their keys): what per-process and stored
    baselines are keyed by; None for a model built in this process (its weights have no name)."""
    if (getattr(handle, "_meta", None) or {}).get("built_in_process"):
        return None
    cfg = handle.cfg
    if not hasattr(cfg, "get"):
        return (str(cfg),)
    ident = tuple(str(cfg.get(k)) for k in ("name", "path"))
    if (dtype := model_dtype_name(cfg, handle.device)) != "float32":
        ident += (f"dtype={dtype}",)
    if (attn := attn_implementation(cfg)) != DEFAULT_ATTN:
        ident += (f"attn={attn}",)
    return ident


def in_file_name(name: str) -> str:
    """A model's name as part of a file or folder name: a hub id's ``/`` (and anything else a path would split or
    a shell would trip on) as ``--``, as the Hugging Face cache writes ``models--org--name``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "--", str(name))


def model_overrides(model_cfg: Any) -> list[str]:
    """The command line overrides that select this model again: ``model=NAME`` for a packaged one, ``model=hf
    model.path=DIR`` (and ``model.name=`` as resolved) for a checkpoint, then ``model.dtype=`` and
    ``model.attn_implementation=`` where they are not float32 and sdpa."""
    name, path = _get(model_cfg, "name"), _get(model_cfg, "path")
    if _get(model_cfg, "source") == "hf":
        out = ["model=hf", f"model.path={path}", f"model.name={name}"]
    else:
        out = [f"model={name}"] + ([f"model.path={path}"] if path not in (None, "") else [])
    if (dtype := _get(model_cfg, "dtype")) not in (None, "float32"):
        out.append(f"model.dtype={dtype}")
    if (attn := attn_implementation(model_cfg)) != DEFAULT_ATTN:
        out.append(f"model.attn_implementation={attn}")
    return out


def model_fields(handle: Any, cfg: Any) -> dict[str, str]:
    """``model_dtype`` and ``attn_implementation`` for a summary: what the loaded model runs with, or, where a run on
    a stored trace never loads it, what the run's config ``cfg`` loads (the trace was captured so: both are in its
    key, and a trace of another dtype is refused)."""
    if getattr(handle, "loaded", False):
        model = handle.model
        return {"model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "attn_implementation": str(getattr(model.config, "_attn_implementation", None)
                                           or attn_implementation(cfg.model))}
    return {"model_dtype": model_dtype_name(cfg.model, str(cfg.device)),
            "attn_implementation": attn_implementation(cfg.model)}


class ModelHandle:
    """Loads the model and tokenizer on first use, so that runs on a stored trace need not load them at all."""

    def __init__(self, model_cfg: Any, device: str = "cpu") -> None:
        check_model_cfg(model_cfg)
        self.cfg, self.device = model_cfg, device
        self._model = self._tok = None

    @classmethod
    def from_loaded(cls, model: Any, tokenizer: Any, model_cfg: Any) -> ModelHandle:
        """Wrap an already built model (tests build tiny random ones)."""
        h = cls(model_cfg, str(next(model.parameters()).device))
        h._model, h._tok, h._meta = model.eval(), tokenizer, {"built_in_process": True}
        return h

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model_dir(self.cfg)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError("device=cuda was asked for but torch sees no CUDA device; use device=cpu")
        self._tok = AutoTokenizer.from_pretrained(path)
        self._model = AutoModelForCausalLM.from_pretrained(
            path, dtype=MODEL_DTYPES[model_dtype_name(self.cfg, self.device)],
            attn_implementation=attn_implementation(self.cfg)).to(self.device).eval()
        meta_file = path / "kvbench_asset.json"
        self._meta = json.loads(meta_file.read_text()) if meta_file.exists() else {"path": str(path)}

    @property
    def loaded(self) -> bool:
        """True once the weights are in memory (a run on a stored trace without NLL never loads them)."""
        return self._model is not None

    @property
    def model(self) -> Any:
        if self._model is None:
            self._load()
        return self._model

    @property
    def config(self) -> Any:
        """The model's transformers config, read without loading the weights when they are not in memory."""
        if self._model is not None:
            return self._model.config
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(resolve_model_dir(self.cfg))

    @property
    def tokenizer(self) -> Any:
        if self._tok is None:
            self._load()
        return self._tok

    @property
    def info(self) -> ModelInfo:
        return describe(self.model, self.cfg.name, self.cfg.source, self._meta)
