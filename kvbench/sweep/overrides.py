"""Command-line overrides of compressor fields, made to apply to the compressor each cell selects.

A multirun over compressors (``-m +compressor=turboquant,kvquant compressor.bits=4``) composes its sweep config
without the compressor group, which only each cell selects, so Hydra refuses a fixed ``compressor.bits=4`` on a node
that is not there yet, with advice (``+compressor.bits=4``) that is wrong here; a swept field
(``compressor.bits=2,3``) is applied per cell and works. :func:`per_cell` rewrites a fixed field into a sweep of its
one value (``++compressor.bits=choice(4)``), which each cell applies after selecting its compressor, and refuses, in
one line and before any cell runs, a field that a selected compressor does not have, naming that compressor and its
fields (in a single run too, where Hydra's advice to append it would only fail later).
"""

from __future__ import annotations

import dataclasses

from kvbench.core.config import available, compressor_class

GROUP = "compressor"


def _parse(arg: str):
    """The Hydra override ``arg``, or None for a flag, a flag's value or anything Hydra itself will judge."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if arg.startswith("-") or "=" not in arg:
        return None
    try:
        return OverridesParser.create().parse_override(arg)
    except HydraException:
        return None


def _selected(override) -> list[str]:
    """The compressor names a ``+compressor=...`` override selects (one, or each of a sweep's)."""
    from hydra.core.override_parser.types import ValueType

    if not override.is_sweep_override():
        return [str(override.value())]
    if override.value_type == ValueType.GLOB_CHOICE_SWEEP:
        return override.value().filter(available(GROUP))
    return list(override.sweep_string_iterator())


def _fields(name: str) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(compressor_class(name)))


def _some(names: list[str]) -> str:
    """``kivi has`` / ``kivi, fp8 have``: the names a message says have (or lack) a field."""
    return f"{', '.join(names)} {'has' if len(names) == 1 else 'have'}"


def per_cell(argv: list[str]) -> list[str]:
    """``argv`` with each fixed ``compressor.FIELD=VALUE`` of a sweep over compressors rewritten to apply in each
    cell; a ValueError names a selected compressor that lacks the field."""
    from hydra.core.override_parser.types import OverrideType

    parsed = [_parse(a) for a in argv]
    groups = [o for o in parsed if o is not None and o.key_or_group == GROUP and not o.is_delete()]
    if not groups:
        return list(argv)
    names = [n for n in _selected(groups[-1]) if n in available(GROUP)]  # an unknown name: Hydra lists the choices
    # a swept group is composed only per cell: a fixed field must become a per-cell sweep of its one value
    swept = groups[-1].is_sweep_override()
    out = []
    for arg, o in zip(argv, parsed):
        # +compressor.FIELD / ++compressor.FIELD: the user chose how it applies
        if o is None or o.type != OverrideType.CHANGE or not o.key_or_group.startswith(f"{GROUP}."):
            out.append(arg)
            continue
        key, field = o.key_or_group, o.key_or_group.split(".")[1]
        # _target_ names the class itself (a plugin of one's own): every compressor's config has it
        lacking = [] if field == "_target_" else [n for n in names if field not in _fields(n)]
        if lacking:
            having = [n for n in names if n not in lacking]
            raise ValueError(f"{arg} cannot apply to {'every cell' if swept else 'this run'}: {_some(lacking)} no "
                             f"field {field!r} ({lacking[0]}'s fields are {_fields(lacking[0])})"
                             + (f"; {_some(having)} it: sweep the compressors without it in a run of their own"
                                if having else ""))
        # added or replaced (++): the node exists only in each cell's own composition
        out.append(f"++{key}=choice({arg.split('=', 1)[1]})" if swept and not o.is_sweep_override() else arg)
    return out
