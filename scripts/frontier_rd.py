"""The frontier's points against the weighted Gaussian R(D): the cells closest to each quality axis and FP8.

    .venv/bin/python scripts/frontier_rd.py [--no-run] [--force] [--only "OVERRIDE ..."]... [OVERRIDE ...]

Runs the cells of configs/experiment/frontier_rd_*.yaml that have no finished run, on the frontier's 16 test
windows, then publishes the runs as the study's evidence; results/frontier.md shows them in its ``frontier_rd``
block (rebuilt by ``python -m kvbench report --pages``).
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("frontier_rd", __doc__.split("\n\n")[0], **study("frontier_rd").options()))
