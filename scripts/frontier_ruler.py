"""The frontier on RULER: each coder's fewest stream bits within 1% NLL, with FP8 and eviction, at 1,024 tokens.

    .venv/bin/python scripts/frontier_ruler.py [--no-run] [--force] [--only "OVERRIDE ..."]... [OVERRIDE ...]

Runs the eval cells of configs/experiment/frontier_ruler_*.yaml that have no finished run (reproduce.sh runs the
cells its study lists, per model), then publishes the runs as the study's evidence; results/frontier.md shows them in
its ``frontier_ruler`` block (rebuilt by ``python -m kvbench report --pages``). Each cell's contexts are prefilled at
16 bits once and kept under ``KVBENCH_HOME/prefills``, so a later cell pays for encode, decode, the question's
prefill and the greedy answer only.
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("frontier_ruler", __doc__.split("\n\n")[0], **study("frontier_ruler").options()))
