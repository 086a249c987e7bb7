"""AQUA-KV's predictors (arXiv 2501.19392): the ridge fit of a layer's linear predictor, the stored weights as the
decoder uses them, and the prediction itself, on one torch thread. The method is described in
:mod:`compressors.transform.aquakv`."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from compressors.predictive import fit_numerics
from compressors.predictive.integer_weights import QuantizedWeights


def ridge_fit(X: np.ndarray, Y: np.ndarray, ridge: float) -> np.ndarray:
    """``W`` ``(n_in + 1, n_out)`` float64 minimising ``||Y − [X, 1] W||² + λ||W||²``, ``λ = ridge · mean diag(G)``
    with ``G = [X, 1]ᵀ[X, 1]``.

    ``X`` ``(N, n_in)``, ``Y`` ``(N, n_out)``. Normal equations in float64 and their solve, one system at a time
    (:mod:`compressors.predictive.fit_numerics`: the stored 8-bit weights then round the same on any machine);
    least squares where ``ridge=0`` leaves them singular.
    """
    Xa = torch.empty((X.shape[0], X.shape[1] + 1), dtype=torch.float64)
    Xa[:, :-1] = torch.from_numpy(X)
    Xa[:, -1] = 1.0  # the bias input
    G = fit_numerics.gemm(Xa.T, Xa)  # (n_in + 1, n_in + 1)
    R = fit_numerics.gemm(Xa.T, torch.from_numpy(Y))  # (n_in + 1, n_out)
    G.diagonal().add_(ridge * max(float(G.diagonal().mean()), 1e-12))
    return fit_numerics.solve(G, R).numpy()


def real_weights(q: QuantizedWeights) -> torch.Tensor:
    """The real weights ``w · 2**-shift`` as the decoder uses them, float32 ``(..., n_in + 1, n_out)``."""
    return torch.ldexp(q.w.double(), -q.shift.double().unsqueeze(-2)).float()


def predict(W: torch.Tensor, *inputs: np.ndarray) -> np.ndarray:
    """``[x_1, ..., x_k, 1] · W`` for inputs ``(T, n_i)`` and ``W`` ``(sum n_i + 1, n_out)``: ``(T, n_out)`` float32.

    Summed in float64 and rounded to float32 once (:func:`compressors.predictive.fit_numerics.gemm`): a float32
    sum's last bit depends on the machine's BLAS, and the fit's closed loop would carry it into the codes of every
    later layer and into the fitted weights.
    """
    out = W[-1].double()
    row = 0
    for x in inputs:  # one product per input block: no concatenated copy of the inputs
        out = out + fit_numerics.gemm(torch.from_numpy(x), W[row : row + x.shape[1]])  # (T, n_out)
        row += x.shape[1]
    return out.float().numpy()


@contextmanager
def one_thread():
    """Run torch on one thread inside the block (restored after).

    The codec's loop over layers is a chain of small dependent matmuls (T x H·D by H·D x H·D). On a shared 2-core
    machine each of torch's parallel regions waits for its second thread to be scheduled: under a load average of
    10, one (1024 x 192) @ (192 x 192) product took 31 ms on two threads and 3.3 ms on one. numpy's own BLAS has
    a thread pool too (14 ms under the same load), so the matmuls stay in torch and torch stays on one thread.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
