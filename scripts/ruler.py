"""RULER-style long-context accuracy with compressed caches (SmolLM2-135M, 1,024-token prompts, 5 examples per task).

    .venv/bin/python scripts/ruler.py [--no-run] [--force] [OVERRIDE ...]

Runs the eval cells of configs/experiment/ruler*.yaml that have no finished run (in one process on one loaded model;
nothing in it is timed for publication), then publishes the runs as the study's evidence and rebuilds results/accuracy.md from its source and
that evidence (results/report/ruler/); the section's own tables go to results/sweeps/ruler/report/.
For the second model: ``model=gemma3_270m``.
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("ruler", __doc__.split("\n\n")[0], **study("ruler").options()))
