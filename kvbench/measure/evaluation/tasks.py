"""The offline task definitions: lm-eval task configs (YAML shipped in ``task_defs/``) bound to local data files."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from kvbench.inputs.assets import BIGBENCH_TASKS, MODELS
from kvbench.inputs.models import model_overrides
from kvbench.measure.evaluation import ruler
from kvbench.measure.evaluation import task_data as data

TASK_DEFS = Path(__file__).resolve().parent / "task_defs"
RULER_GROUP = "ruler"  # every RULER family at every length
BIGBENCH_GROUP = "bigbench"  # every BIG-bench task (opt-in: their files are not downloadable, see task_data)
GROUPS = {RULER_GROUP: tuple(ruler.FAMILIES), BIGBENCH_GROUP: BIGBENCH_TASKS}
TASKS = (BIGBENCH_GROUP, *BIGBENCH_TASKS, "passkey", "sotu_lastword", RULER_GROUP, *ruler.FAMILIES)
# the fields each data file's rows must have (checked before lm-eval reads the file)
FIELDS = {"bigbench": ("context", "query", "choices", "label"), "passkey": ("context", "query", "passkey"),
          "sotu_lastword": ("context", "target"), "ruler": ruler.FIELDS}


def _resolve(ref: Any) -> Any:
    """A ``package.module:function`` reference in a template, imported (lm-eval takes the callable itself)."""
    if not isinstance(ref, str):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep:
        raise ValueError(f"process_results must be given as 'package.module:function'; got {ref!r}")
    return getattr(importlib.import_module(module), attr)


def task_config(template: str, name: str, path: Path) -> dict[str, Any]:
    """The shipped YAML ``template`` as an lm-eval task config named ``name``, reading its test split from ``path``."""
    spec = yaml.safe_load((TASK_DEFS / f"{template}.yaml").read_text())
    if "process_results" in spec:
        spec["process_results"] = _resolve(spec["process_results"])
    return {"task": name, **spec, "dataset_kwargs": {"data_files": {"test": str(path)}}}


def length_suffix(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def passkey_name(length: int) -> str:
    return f"passkey_{length_suffix(length)}"


def ruler_name(family: str, length: int) -> str:
    return f"{family}_{length_suffix(length)}"


def expand(names: list[str]) -> list[str]:
    """``names`` with each group (``ruler``, ``bigbench``) replaced by its tasks, first occurrence kept."""
    out: list[str] = []
    for name in names:
        for n in GROUPS.get(name, [name]):
            if n not in out:
                out.append(n)
    return out


def _rebuild(cfg: Any, task: str, *overrides: str) -> str:
    """How to build a task's data file again: delete it and rerun a command that asks for the task."""
    model = model_overrides(cfg.model) if OmegaConf.is_config(cfg) and cfg.get("model") is not None else []
    args = " ".join([*model, f"tasks=[{task}]", *overrides, f"seed={int(cfg.seed)}", "limit=1"])
    return f"delete it and rerun `python -m kvbench eval +compressor=identity {args}` to build it again"


def _floats(xs: Any) -> str:
    return "[" + ",".join(str(x) for x in xs) + "]"


def task_specs(names: list[str], cfg: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """lm-eval task configs (dicts) for the task names in ``names``; builds the data files on first use and checks
    that each one reads as the task's rows."""
    unknown = sorted(set(names) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; available: {list(TASKS)}")
    if not names:
        raise ValueError(f"no tasks chosen; set tasks=[...] with names from {list(TASKS)}")
    specs = []
    for name in expand(list(names)):
        if name in BIGBENCH_TASKS:
            path = data.bigbench_data(name, int(cfg.bigbench.pool), int(cfg.seed))
            data.check_jsonl(path, FIELDS["bigbench"], _rebuild(cfg, name, f"bigbench.pool={int(cfg.bigbench.pool)}"))
            specs.append(task_config("bigbench", name, path))
        elif name == "passkey":
            pk = cfg.passkey
            for length in pk.lengths:
                path = data.passkey_data(tokenizer, int(length), [float(d) for d in pk.depths], int(pk.per_depth), int(cfg.seed))
                data.check_jsonl(path, FIELDS["passkey"], _rebuild(cfg, name, f"passkey.lengths=[{int(length)}]",
                                                                   f"passkey.depths={_floats(pk.depths)}", f"passkey.per_depth={int(pk.per_depth)}"))
                spec = task_config("passkey", passkey_name(int(length)), path)
                spec["generation_kwargs"] = {**spec["generation_kwargs"], "max_gen_toks": int(pk.max_gen_toks)}
                specs.append(spec)
        elif name in ruler.FAMILIES:
            specs += _ruler_specs(name, cfg, tokenizer)
        else:
            lw = cfg.lastword
            path = data.lastword_data(tokenizer, int(lw.n), int(lw.context_tokens), int(cfg.seed))
            data.check_jsonl(path, FIELDS["sotu_lastword"], _rebuild(cfg, name, f"lastword.n={int(lw.n)}",
                                                                     f"lastword.context_tokens={int(lw.context_tokens)}"))
            specs.append(task_config("sotu_lastword", name, path))
    return specs


_INSTRUCT = re.compile(r"instruct|chat|-it\b", re.IGNORECASE)


def uses_chat_template(cfg: Any, tokenizer: Any) -> bool:
    """``ruler.chat_template``: true, false, or ``auto`` (the default): the tokenizer's chat template for a model
    tuned to follow instructions (its Hugging Face id or path says instruct, chat or -it), plain text for a base
    model, whose tokenizer may carry its instruction-tuned sibling's template."""
    sel = (lambda key, d=None: OmegaConf.select(cfg, key, default=d)) if OmegaConf.is_config(cfg) else (lambda key, d=None: d)
    want = sel("ruler.chat_template", "auto")
    has = bool(getattr(tokenizer, "chat_template", None))
    if want == "auto":
        name = str(sel("model.name", ""))
        # a local checkpoint by its name (a hub id, where it has one) and its folder
        source = (MODELS[name].hf_id if name in MODELS and sel("model.source") != "hf"
                  else f"{name} {sel('model.path', '') or ''}")
        return has and bool(_INSTRUCT.search(source))
    if want is True and not has:
        raise ValueError("ruler.chat_template=true, but this model's tokenizer has no chat template; use false or auto")
    if want not in (True, False):
        raise ValueError(f"ruler.chat_template={want!r} is not allowed; choose one of ['auto', True, False]")
    return bool(want)


def _ruler_specs(family: str, cfg: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """One task per ``ruler.lengths`` entry; ``ruler.max_gen_toks`` (if set) overrides the family's own budget."""
    rc = cfg.ruler
    budget = ruler.FAMILIES[family].max_gen_toks if rc.max_gen_toks is None else int(rc.max_gen_toks)
    chat = uses_chat_template(cfg, tokenizer)
    specs = []
    for length in rc.lengths:
        path = ruler.ruler_data(tokenizer, family, int(length), int(rc.per_length), int(cfg.seed), chat)
        data.check_jsonl(path, FIELDS["ruler"], _rebuild(cfg, family, f"ruler.lengths=[{int(length)}]",
                                                         f"ruler.per_length={int(rc.per_length)}"))
        spec = task_config("ruler", ruler_name(family, int(length)), path)
        spec["generation_kwargs"] = {**spec["generation_kwargs"], "max_gen_toks": budget}
        specs.append(spec)
    return specs
