"""Hyperparameters of the fitted coders chosen on the development split (SmolLM2-135M, dataset.split=dev).

    .venv/bin/python scripts/dev_split.py [--no-run] [--force] [OVERRIDE ...]

Runs the cells of configs/experiment/dev_*.yaml that have no finished run (every one on dataset.split=dev: windows
from other documents than the test windows, the test runs' calibration windows), then writes the report section
dev_split (results/report/dev_split.{md,tex,csv}): every candidate with its held-out NLL change on the dev windows,
and per coder and budget the one chosen. For the second model: ``model=gemma3_270m``.
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("dev_split", __doc__.split("\n\n")[0], **study("dev_split").options()))
