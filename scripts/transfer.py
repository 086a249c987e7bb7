"""What holds where: every coder family's frontier setting on the three packaged models, with the recall probe and
the attention errors the model's own queries see.

    .venv/bin/python scripts/transfer.py [--no-run] [--force] [--only "OVERRIDE ..."]... [OVERRIDE ...]

Runs the cells of configs/experiment/transfer_*.yaml that have no finished run (in one process, each measured cell
under the benchmark lock; runs under results/runs), then publishes the newest run of each cell as the study's
evidence (results/evidence/transfer/) and rebuilds results/transfer.md from its source
(results/evidence/pages/transfer.md) and that evidence, with the report section transfer (results/report/transfer/).
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("transfer", __doc__.split("\n\n")[0], **study("transfer").options()))
