"""Waterfill allocating by what a later query needs, at the recall goal's 2-bit budget, beside FP8, on dev windows.

    .venv/bin/python scripts/dev_recall.py [--no-run] [--force] [--only "OVERRIDE ..."]... [OVERRIDE ...]

Runs the cells of configs/experiment/dev_recall_*.yaml that have no finished run, on 16 development windows,
then publishes the runs as the study's evidence; results/dev_split.md shows them in its ``dev_recall`` block
(rebuilt by ``python -m kvbench report --pages``).
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("dev_recall", __doc__.split("\n\n")[0], **study("dev_recall").options()))
