"""Cells and presets: one cell of any measuring command (reuse a finished run or measure it), a study preset's cells."""
