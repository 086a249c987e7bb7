"""Token eviction on both packaged models: every method keeping a quarter and a half of the tokens per layer and
KV head (kept positions coded and counted; KVzip and AdaKV over ExpectedAttention among them), the kept KV of SnapKV
coded by TurboQuant and of KVzip and AdaKV by FP8 or KIVI 4-bit, and the frontier presets' per-vector quantizers and
FP8 cache as the reference at similar stored bits.

    .venv/bin/python scripts/eviction.py [--no-run] [--force] [--only "OVERRIDE ..."]... [OVERRIDE ...]

Runs the cells of configs/experiment/eviction*.yaml and frontier_{kivi,turboquant,fp8}.yaml that have no finished run
(in one process, each measured cell under the benchmark lock; runs under results/runs), then exports its evidence
(the frontier's cells borrowed at their own commit), writes the report section eviction under
results/sweeps/eviction/report/ and rebuilds its page, results/eviction.md.
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("eviction", __doc__.split("\n\n")[0], **study("eviction").options()))
