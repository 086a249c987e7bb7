"""Task-accuracy regression of compressed caches at matched bits (SmolLM2-135M, configs/eval.yaml defaults).

    .venv/bin/python scripts/accuracy.py [--no-run] [--force] [OVERRIDE ...]

Runs the eval cells of configs/experiment/matched_bits*.yaml that have no finished run (in one process on one
loaded model, without the lock: nothing in it is timed for publication), then exports its evidence and writes the report section
accuracy under results/sweeps/accuracy/report/. Its BIG-bench tasks need a local copy of BIG-bench's task files
(the registry no longer serves the bigbench 1.0.0 sdist); no page is published from it.
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("accuracy", __doc__.split("\n\n")[0], **study("accuracy").options()))
