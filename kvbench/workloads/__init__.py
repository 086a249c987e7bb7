"""Multi-session workloads (the ``workload=`` config group) and their sharing statistics.

``shared_system``, ``fewshot``, ``doc_qa``, ``multiturn`` and ``mixed`` build request sets from the run's text
and BIG-bench tasks; :func:`~kvbench.workloads.hash_trace.read_hash_trace` reads public block-hash traces.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvbench.workloads.base import Session, Workload, WorkloadBuilder, sharing_stats

__all__ = ["Session", "Workload", "WorkloadBuilder", "make_workload", "selected", "sharing_stats"]


def selected(node: Any) -> bool:
    """True when a run config's ``workload`` node names a workload (``workload=none`` does not)."""
    return node is not None and bool(node.get("_target_"))


def make_workload(node: Any) -> WorkloadBuilder:
    """Instantiate a ``workload`` config node (selected by ``_target_``), naming the fields on a typo."""
    import hydra.utils
    from omegaconf import OmegaConf

    from kvbench.config import available

    spec = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    target = spec.get("_target_")
    if not target:
        raise ValueError(f"no workload chosen; available: {available('workload')}")
    cls = hydra.utils.get_class(target)
    if not (isinstance(cls, type) and issubclass(cls, WorkloadBuilder)):
        raise ValueError(f"workload _target_ {target} is not a kvbench WorkloadBuilder")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(spec) - fields - {"_target_"})
    if unknown:
        raise ValueError(f"workload {cls.name!r} has no field(s) {unknown}; its fields are {sorted(fields)}")
    try:
        return hydra.utils.instantiate(spec, _convert_="all")
    except Exception as e:  # hydra wraps the ValueError from __post_init__; surface the original message
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise ValueError(str(cause)) from e
