"""The float64 products, solves and eigendecompositions that fitted coders learn their state with, one entry point
each, so that a fit's state is the same bytes on every machine.

Why: a fit's state is stored in a coarse precision (8-bit weights, float16 bases and scales, float32 codebooks). A
machine whose BLAS sums in another order (another CPU's kernels, another thread count) or whose LAPACK factors
another way changes a float64 result in its last bits; rounded to the stored precision that is the same number
except on a rounding boundary, which a float64 result within a few ulps lands on with a probability of about
``2**-29`` per float32 value and far less for 8-bit or float16 ones. A float32 product, by contrast, differs in a
float32 ulp, and its rounding flips every few thousand values: the fitted state then differs, and with a closed-loop
fit (AQUA-KV) the difference spreads to every later layer. So every sum a fit rounds goes through :func:`gemm` in
float64, every system through :func:`solve`, every basis through :func:`eigh` with its signs fixed, and the result
is rounded to the stored precision only at the end.

:func:`another_path` runs all three through a different, equally valid path (sums in reversed order and in two
blocks, Cholesky instead of LU, the matrix's rows and columns permuted before the eigendecomposition): what another
machine's libraries do, on this one. ``tests/test_fit_determinism.py`` fits every coder both ways and asserts the
same state bytes.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

_OTHER = contextvars.ContextVar("fit_numerics_other_path", default=False)


@contextmanager
def another_path() -> Iterator[None]:
    """Inside the block, :func:`gemm`, :func:`solve` and :func:`eigh` take another order of sums and another
    factorization (the results agree to float64 rounding, not bit for bit)."""
    token = _OTHER.set(True)
    try:
        yield
    finally:
        _OTHER.reset(token)


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float64, batched as ``torch.matmul``: ``(..., n, k) @ (..., k, m)`` -> ``(..., n, m)``."""
    a, b = a.double(), b.double()
    if not _OTHER.get():
        return a @ b
    k = a.shape[-1]
    flip = torch.arange(k - 1, -1, -1)
    a, b = a[..., flip], b[..., flip, :]  # reversed summation order, in two blocks added at the end
    half = k // 2
    return a[..., :half] @ b[..., :half, :] + a[..., half:] @ b[..., half:, :]


def solve(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A X = B`` for symmetric positive (semi)definite ``A`` ``(..., n, n)`` and ``B`` ``(..., n, m)``, float64.

    In numpy (LU), one system at a time: torch's batched ``linalg.solve`` runs MKL's threaded LU inside its own
    OpenMP loop over the batch, and that nesting can spin forever on two cores (seen with 29 systems of 193
    unknowns). Least squares where ``A`` is singular.
    """
    A64, B64 = A.double().numpy(), B.double().numpy()
    out = np.empty(B64.shape)
    for idx in np.ndindex(*A64.shape[:-2]):
        a, b = A64[idx], B64[idx]
        if _OTHER.get():
            try:
                c = np.linalg.cholesky(a)
                out[idx] = np.linalg.solve(c.T, np.linalg.solve(c, b))
                continue
            except np.linalg.LinAlgError:
                pass
        try:
            out[idx] = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            out[idx] = np.linalg.lstsq(a, b, rcond=None)[0]
    return torch.from_numpy(out)


def eigh(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending) and eigenvectors ``(n,), (n, n)`` of a symmetric float64 matrix, each eigenvector's
    sign fixed (:func:`canonical_signs`), on one torch thread (a few hundred dimensions: one thread is several times
    faster than two fighting for a loaded machine)."""
    A = A.double()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if _OTHER.get():
            n = A.shape[-1]
            perm = torch.arange(n - 1, -1, -1)
            var, vec = torch.linalg.eigh(A[perm][:, perm])
            vec = vec[torch.argsort(perm)]
        else:
            var, vec = torch.linalg.eigh(A)
    finally:
        torch.set_num_threads(threads)
    return var, canonical_signs(vec)


def canonical_signs(vec: torch.Tensor) -> torch.Tensor:
    """Columns of ``vec`` ``(n, r)`` with the sign that makes each one's sum positive (its entry of largest magnitude
    where the sum is nearly 0): an eigenvector's sign is arbitrary, and two LAPACKs choose differently."""
    total = vec.sum(dim=0)  # (r,)
    peak = vec.gather(0, vec.abs().argmax(dim=0, keepdim=True))[0]  # (r,)
    # a sum this small is all rounding; then the largest entry (unique unless two are equal to the last bit) decides
    pick = torch.where(total.abs() > 1e-6 * vec.abs().sum(dim=0), total, peak)
    return vec * torch.where(pick < 0, -1.0, 1.0).to(vec.dtype)
