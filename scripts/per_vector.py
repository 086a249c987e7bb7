"""Per-vector quantizers on the run defaults: TurboQuant (TQ_mse, TQ_prod) at 2-4 bits in half-bit steps against KIVI
at whole bits, with its 128-token 16-bit window and without.

    .venv/bin/python scripts/per_vector.py [--no-run] [--force] [OVERRIDE ...]

Runs the cells of configs/experiment/per_vector_{turboquant,kivi}.yaml that have no finished run (in one process,
each measured cell under the benchmark lock; runs under results/runs), then exports its evidence and writes the
report section per_vector under results/sweeps/per_vector/report/ (no page: results/README.md shows the reproduce
study's per-vector cells).
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("per_vector", __doc__.split("\n\n")[0], **study("per_vector").options()))
