"""Eviction on RULER at the leaderboard's compression ratios: KVzip, AdaKV and PyramidKV budgets and the others.

    .venv/bin/python scripts/eviction_ruler.py [--no-run] [--force] [--only "OVERRIDE ..."]... [OVERRIDE ...]

Runs the eval cells of configs/experiment/eviction_ruler*.yaml (and the FP8 reference cell it borrows from the
frontier's RULER study) that have no finished run, then publishes the runs as the study's evidence
(results/evidence/eviction_ruler/), writes the section eviction_ruler's tables and figures under
results/sweeps/eviction_ruler/report/ and rebuilds its page, results/eviction_ruler.md. The contexts' 16-bit
prefills are those of the frontier's RULER cells, kept under ``KVBENCH_HOME/prefills``; ``--only
"model=smollm2_135m"`` runs one model's cells together.
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("eviction_ruler", __doc__.split("\n\n")[0], **study("eviction_ruler").options()))
