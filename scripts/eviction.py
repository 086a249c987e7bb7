"""Token eviction on both packaged models: every method keeping a quarter and a half of the tokens per layer and
KV head (kept positions coded and counted), SnapKV with its kept KV coded by TurboQuant, and the per-vector
quantizers of the frontier presets as the reference at similar stored bits.

    .venv/bin/python scripts/eviction.py [--no-run] [--force] [OVERRIDE ...]

Runs the cells of configs/experiment/eviction{,_inner}.yaml and frontier_{kivi,turboquant}.yaml that have no
finished run (in one process, each measured cell under the benchmark lock; runs under results/runs), then exports its
evidence and writes the report section eviction under results/sweeps/eviction/report/ (no page: results/README.md's
section 3 shows the reproduce study's eviction cells).
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("eviction", __doc__.split("\n\n")[0], **study("eviction").options()))
