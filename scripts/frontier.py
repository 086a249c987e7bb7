"""The frontier on both packaged models: the fitted transform and predictive coders (KVTC, AQUA-KV, KVQuant,
range-coded TurboQuant) beside the per-vector and delta references (KIVI, TurboQuant, delta), each cell's rate as
stream bits per element and its held-out NLL change with a paired 95% interval.

    .venv/bin/python scripts/frontier.py [--no-run] [--force] [OVERRIDE ...]

Runs the cells of configs/experiment/frontier_*.yaml that have no finished run (in one process, each measured cell
under the benchmark lock; runs under results/runs), then publishes the newest run of each cell as the
study's evidence (results/evidence/frontier/) and rebuilds results/frontier.md from its source
(results/evidence/pages/frontier.md) and that evidence, with the report section frontier
(results/report/frontier/: frontier.{md,tex,csv}, figures/frontier_<model>.{png,pdf}).
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("frontier", __doc__.split("\n\n")[0], **study("frontier").options()))
