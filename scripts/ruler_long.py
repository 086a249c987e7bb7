"""RULER at 4,096 tokens: the transfer settings, FP8 and eviction keeping half, on the three packaged models.

    .venv/bin/python scripts/ruler_long.py [--no-run] [--force] [--only "OVERRIDE ..."]... [OVERRIDE ...]

Runs the eval cells of configs/experiment/ruler_long_*.yaml that have no finished run, then publishes the runs as
the study's evidence (results/evidence/ruler_long/) and writes the section ruler_long's tables under
results/sweeps/ruler_long/report/. Each context is prefilled at 16 bits once and kept under ``KVBENCH_HOME/prefills``,
so the first cell of a model pays for the prefills and later ones load them: ``--only "model=smollm2_135m"`` runs
one model's cells together.
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("ruler_long", __doc__.split("\n\n")[0], **study("ruler_long").options()))
