"""Refusing a window longer than the model's positions before any work is done.

Past the positions a model was trained on, RoPE angles it never saw (or a learned position table that ends) make
its output something else than the model's; nothing fails, so a run beyond them (``dataset.seq_len=9000`` on
SmolLM2's 8,192) would report a rate and a task loss of a model that does not exist. The model's positions are the
text config's ``max_position_embeddings``, or, where the config declares long-context RoPE scaling with a factor
over ``original_max_position_embeddings`` (YaRN, dynamic NTK, Llama 3), that product when it is larger.

A dataset window is ``seq_len + eval_len + 1`` tokens: the prefix, the continuation fed on top of it and the last
continuation token, which is only a target. So the model reads ``seq_len + eval_len`` positions, or
``seq_len + recall_tokens`` for the long-range probe (a copy of an early passage fed after the prefix) where that is
longer. ``dataset.allow_beyond_positions=true`` runs such a window anyway, and the run summary records it.
"""

from __future__ import annotations

from typing import Any

ALLOW = "dataset.allow_beyond_positions"


class BeyondPositions(ValueError):
    """A window would feed the model more positions than it has."""


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)


def position_limit(config: Any) -> tuple[int | None, str]:
    """``(positions, where they come from)`` of a transformers config; ``(None, ...)`` where it declares none."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    limit = getattr(c, "max_position_embeddings", None)
    source = "max_position_embeddings"
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    # one parameter set, or one per layer type (Gemma 3: full_attention, sliding_attention)
    sets = list(rope.values()) if rope and all(isinstance(p, dict) for p in rope.values()) else [rope]
    for params in sets:
        factor, original = params.get("factor"), params.get("original_max_position_embeddings")
        if factor and original and factor * original > (limit or 0):
            kind = params.get("rope_type", params.get("type", "?"))
            limit, source = int(factor * original), f"{kind} RoPE scaling: factor {factor} x original_max_position_embeddings {original}"
    return (None if limit is None else int(limit)), source


def window_positions(ds: Any, metrics: Any = None) -> int:
    """Positions a dataset window feeds the model: the prefix and the longer of the continuation and the
    long-range probe."""
    recall = int(_get(metrics, "recall_tokens", 0) or 0) if metrics is not None else 0
    return int(ds.seq_len) + max(int(ds.eval_len), recall)


def allowed_beyond(ds: Any) -> bool:
    """``dataset.allow_beyond_positions`` (default false)."""
    return bool(_get(ds, "allow_beyond_positions", False))


def check_positions(ds: Any, metrics: Any, config: Any, model_name: str) -> None:
    """Raise :class:`BeyondPositions` if the window of ``ds`` feeds ``config``'s model more positions than it has,
    unless ``dataset.allow_beyond_positions`` is set."""
    limit, source = position_limit(config)
    need = window_positions(ds, metrics)
    if limit is None or need <= limit or allowed_beyond(ds):
        return
    recall = int(_get(metrics, "recall_tokens", 0) or 0) if metrics is not None else 0
    longest = (f"metrics.recall_tokens={recall}" if recall > int(ds.eval_len) else f"dataset.eval_len={ds.eval_len}")
    raise BeyondPositions(
        f"dataset.seq_len={ds.seq_len} with {longest} feeds the model {need:,} positions, beyond {model_name}'s "
        f"{limit:,} ({source}); nothing was captured or measured. Shorten the window, or set {ALLOW}=true to run "
        "it past the model's positions anyway (the summary records allow_beyond_positions)")
