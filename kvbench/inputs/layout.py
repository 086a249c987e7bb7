"""Which of a dataset's seeded windows each role takes: the test windows every study scores, the development windows
hyperparameters are chosen on, the calibration windows fitted coders fit, and the further calibration draws of
``metrics.fit_draws``.

The dataset's windows come in one seeded order (:func:`kvbench.inputs.data.draw_windows`: one window per document
while the text has as many documents as windows drawn). They are dealt out in turn, ``test, dev, calib, draws,
test, dev, ...``, so that

- no window (and, on a text with enough documents, no document) serves two roles, at any sizes: the 16 test windows
  of ``dataset.n_sequences=16`` never include a window that 4 development windows chose a setting on;
- a role's first ``n`` windows are the same for every ``n`` (the default 4 test windows are the first 4 of 16), as
  long as the text cuts its windows the same way (a text with fewer documents than windows cuts more of them from
  each document: :func:`windows_drawn` draws as many for either split so that both are cut alike).
"""

from __future__ import annotations

from typing import Any

#: the roles, in the order the seeded windows are dealt to them
ROLES = ("test", "dev", "calib", "draws")


def role_windows(role: str, n: int, start: int = 0) -> list[int]:
    """Indices into the seeded window order of windows ``start .. start + n - 1`` of ``role``."""
    r = ROLES.index(role)
    return [len(ROLES) * (start + k) + r for k in range(int(n))]


def windows_drawn(ds: Any, calib_windows: int = 0) -> int:
    """How many windows of the seeded order cover a capture of either split of ``ds`` (and ``calib_windows`` further
    calibration windows of the ``draws`` role): the same for ``test`` and ``dev``, so both are cut from one order."""
    return len(ROLES) * max(int(ds.n_sequences), int(ds.n_calib), int(calib_windows), 1)


def capture_windows(ds: Any, split: str) -> tuple[list[int], list[int]]:
    """``(evaluated, calibration)``: the window indices a capture of ``split`` takes. Both splits fit the same
    calibration windows, so a setting chosen on ``dev`` is the one the test split's coder is fitted with."""
    return role_windows(split, ds.n_sequences), role_windows("calib", ds.n_calib)
