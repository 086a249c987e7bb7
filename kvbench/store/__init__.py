"""Where results live and how they are written: paths, atomic writes, locks, run directories and their code version. Imports nothing else of kvbench."""
