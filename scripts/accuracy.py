"""Task-accuracy regression of compressed caches at matched bits (SmolLM2-135M, configs/eval.yaml defaults).

    .venv/bin/python scripts/accuracy.py [--no-run] [--force] [OVERRIDE ...]

Runs the eval cells of configs/experiment/matched_bits*.yaml that have no finished run (in one process on one
loaded model, without the lock: nothing in it is timed for publication), then writes the report section accuracy
(results/report/accuracy.{md,tex,csv}, results/report/figures/accuracy.{png,pdf}) and its table into
results/bigbench.md between its markers.
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("accuracy", __doc__.split("\n\n")[0], **study("accuracy").options()))
