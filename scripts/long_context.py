"""Verdicts at 4,096 tokens: the transfer study's coder settings, as chosen at 1,024 tokens, on 4,096-token windows
of the three packaged models, with the recall probe and the attention errors the model's own queries see.

    .venv/bin/python scripts/long_context.py [--no-run] [--force] [--only "OVERRIDE ..."]... [OVERRIDE ...]

Runs the cells of configs/experiment/long_*.yaml that have no finished run (in one process, each measured cell under
the benchmark lock; runs under results/runs), then publishes the newest run of each cell as the study's evidence
(results/evidence/long_context/) and rebuilds results/long_context.md from its source
(results/evidence/pages/long_context.md) and that evidence, with the report section long_context
(results/report/long_context/). ``--only "model=smollm2_135m"`` measures one model's cells.
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("long_context", __doc__.split("\n\n")[0], **study("long_context").options()))
