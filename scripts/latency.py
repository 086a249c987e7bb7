"""Decode throughput against bytes held: CompressedCache with each compressor against the plain DynamicCache
(SmolLM2-135M, configs/latency.yaml defaults: contexts 512/2048/4096, 64 decoded tokens).

    .venv/bin/python scripts/latency.py [--no-run] [OVERRIDE ...]

Runs every latency cell of configs/experiment/matched_bits*.yaml, latency_lossless.yaml and latency_model.yaml
(the compressors whose decoder re-runs the model: a short context, few tokens), each as its own `python -m kvbench
latency` process (the peak-memory column is the whole process's, which earlier cells would inflate) under the
benchmark lock. Then publishes the runs as the study's evidence and rebuilds results/latency.md from its source and that
evidence (results/report/latency/); the section's own tables go to results/sweeps/end_to_end/report/.
"""

import sys

from kvbench.studies import main
from kvbench.sweep.studies_config import study

if __name__ == "__main__":
    sys.exit(main("end_to_end", __doc__.split("\n\n")[0], **study("end_to_end").options()))
