"""Sequential compressors on the default trace (SmolLM2-135M, SOTU, 4 x 1024 tokens): bits per token against the
entropy bound, and what each costs in time.

    .venv/bin/python scripts/sequential.py [--no-run] [--force] [OVERRIDE ...]

Runs the cells of configs/experiment/sequential*.yaml that have no finished run, single-threaded and each under the
benchmark lock (timed alike on a shared machine), the model-running coders (recompute, speculative: minutes per
window) last, with their runs under results/sweeps/sequential/runs (git-ignored). Then exports its evidence and writes the report
section sequential under results/sweeps/sequential/report/ (no page: results/README.md shows the reproduce study's
sequential cells). The ideal -log2 p columns are the coders' own model estimates
(compressor_stats); the rate itself is always the harness's count of the bitstream.
"""

import sys

from kvbench.sweep.studies_config import pin_threads, study

if __name__ == "__main__":
    pin_threads(study("sequential").driver.threads)  # one torch thread (configs/study/sequential.yaml says why)
    from kvbench.studies import main

    sys.exit(main("sequential", __doc__.split("\n\n")[0], **study("sequential").options()))
