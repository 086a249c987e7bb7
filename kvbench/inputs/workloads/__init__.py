"""Multi-session workloads (the ``workload=`` config group) and their sharing statistics.

``shared_system``, ``fewshot``, ``doc_qa``, ``multiturn`` and ``mixed`` build request sets from the run's text
(``fewshot`` optionally from local BIG-bench task files); :func:`~kvbench.inputs.workloads.hash_trace.read_hash_trace` reads public block-hash traces.
"""

from __future__ import annotations

from typing import Any

from kvbench.inputs.workloads.base import Session, Workload, WorkloadBuilder, sharing_stats

__all__ = ["Session", "Workload", "WorkloadBuilder", "make_workload", "selected", "sharing_stats"]


def selected(node: Any) -> bool:
    """True when a run config's ``workload`` node names a workload (``workload=none`` does not)."""
    return node is not None and bool(node.get("_target_"))


def make_workload(node: Any) -> WorkloadBuilder:
    """Instantiate a ``workload`` config node (selected by ``_target_``), naming the fields on a typo."""
    from kvbench.core.config import instantiate_plugin

    return instantiate_plugin(node, WorkloadBuilder, "workload", "workload")

