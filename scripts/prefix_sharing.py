"""Prefix sharing (Layer 1): exact dedup against the share rate, the prefix cache under a budget (LRU against the
probabilistic language trie), and dedup composed with per-vector and sequential compressors.

    .venv/bin/python scripts/prefix_sharing.py [--no-run] [--force] [--cells] [OVERRIDE ...]

Runs the cells of configs/experiment/prefix_sharing_*.yaml that have no finished run (in one process, each measured
cell under the benchmark lock; runs under results/runs; a failing cell is reported and the others still run), then
exports its evidence and writes the report section prefix_sharing under results/sweeps/prefix_sharing/report/ (no
page: results/README.md's section 5 shows the reproduce study's sharing cells).
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("prefix_sharing", __doc__.split("\n\n")[0], **study("prefix_sharing").options()))
