"""Lloyd-Max codebooks for one coordinate of a uniformly random unit vector in R^d.

TurboQuant (Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate",
arXiv 2504.19874, Sec. 3.1): after a random rotation, each coordinate t of a unit vector follows

    f_d(t) = Γ(d/2) / (√π Γ((d-1)/2)) · (1 - t²)^((d-3)/2)   on [-1, 1]

(close to N(0, 1/d) for large d), so one scalar codebook, optimal for f_d, serves every coordinate and every vector.
We solve for it with Lloyd iterations on the exact density. Both cell integrals have closed forms —
(t + 1)/2 ~ Beta((d-1)/2, (d-1)/2), and ∫ t f_d(t) dt = -C_d (1 - t²)^((d-1)/2) / (d-1) — so each iteration is a
handful of vectorised scipy calls and the result is exact to float64, not to a quadrature grid.

The codebooks are derived, not learned: a decoder recomputes them from (d, bits), so they cost 0 bits. They are
cached in memory and under ``$KVBENCH_HOME/codebooks`` (the iteration is deterministic; the file only saves time).
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass

import numpy as np

from kvbench.store.atomic import write_bytes
from kvbench.store.paths import home

# bump when the solver changes, so that stale cached files are never read
_VERSION = 1
_MAX_ITER = 20_000


@dataclass(frozen=True)
class SphereCodebook:
    """Optimal ``bits``-bit scalar quantizer for one coordinate of a random unit vector in ``d`` dimensions."""

    d: int
    bits: int
    centroids: np.ndarray  # (2**bits,) ascending, symmetric about 0

    @property
    def thresholds(self) -> np.ndarray:
        """Cell boundaries: midpoints between neighbouring centroids (nearest-centroid rule)."""
        return (self.centroids[:-1] + self.centroids[1:]) / 2  # (2**bits - 1,)

    @property
    def cell_probs(self) -> np.ndarray:
        """Probability of each cell under f_d: the law of a code when the vector is uniform on the sphere
        (what an entropy coder of the codes is modelled on). (2**bits,) float64, sums to 1."""
        return _cell_probs(self.d, np.concatenate([[-1.0], self.thresholds, [1.0]]))

    @property
    def unit_mse(self) -> float:
        """Expected ``||u - Q(u)||²`` for a uniform unit vector u quantized coordinate-wise (d times one coordinate).

        At a Lloyd fixed point each centroid is its cell's mean, so the error is E[t²] - Σ P_i c_i² per coordinate,
        with E[t²] = 1/d.
        """
        return float(1.0 - self.d * np.sum(self.cell_probs * self.centroids**2))


def _tail(d: int, t: np.ndarray) -> np.ndarray:
    """P(T > t) for the coordinate density f_d; accurate in the upper tail (no 1 - x cancellation)."""
    from scipy.special import betaincc

    a = (d - 1) / 2
    return betaincc(a, a, (np.clip(t, -1.0, 1.0) + 1) / 2)


def _cell_probs(d: int, edges: np.ndarray) -> np.ndarray:
    return -np.diff(_tail(d, edges))


def _cell_first_moments(d: int, edges: np.ndarray) -> np.ndarray:
    """∫ t f_d(t) dt over each cell [edges[i], edges[i+1]]."""
    from scipy.special import gammaln

    log_c = gammaln(d / 2) - 0.5 * math.log(math.pi) - gammaln((d - 1) / 2)
    g = np.power(np.clip(1 - edges**2, 0.0, None), (d - 1) / 2)
    return math.exp(log_c) * (g[:-1] - g[1:]) / (d - 1)


def _density(d: int, t: np.ndarray) -> np.ndarray:
    from scipy.special import gammaln

    log_c = gammaln(d / 2) - 0.5 * math.log(math.pi) - gammaln((d - 1) / 2)
    return math.exp(log_c) * np.power(np.clip(1 - t**2, 0.0, None), (d - 3) / 2)


def _lloyd_map(d: int, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One Lloyd update (each centroid -> its cell's mean), with the cells' probabilities and edges."""
    edges = np.concatenate([[-1.0], (c[:-1] + c[1:]) / 2, [1.0]])
    p = np.maximum(_cell_probs(d, edges), np.finfo(float).tiny)
    new = _cell_first_moments(d, edges) / p
    return (new - new[::-1]) / 2, p, edges  # exact symmetry; the upper half carries the accurate tails


def _newton_step(d: int, c: np.ndarray, mapped: np.ndarray, p: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Newton step on G(c) = lloyd(c) - c; the Jacobian is tridiagonal (cell i moves only with its two edges)."""
    from scipy.linalg import solve_banded

    inner = edges[1:-1]  # (K-1,) edge j+1 lies between centroids j and j+1
    f = _density(d, inner)
    # d lloyd_i / d edge: upper edge of cell i is inner[i], lower edge is inner[i-1]
    up = f * (inner - mapped[:-1]) / p[:-1]  # (K-1,) d lloyd_i / d inner[i]
    lo = -f * (inner - mapped[1:]) / p[1:]  # (K-1,) d lloyd_{i+1} / d inner[i]
    k = len(c)
    diag = -np.ones(k)
    diag[:-1] += up / 2
    diag[1:] += lo / 2
    ab = np.zeros((3, k))
    ab[0, 1:] = up / 2  # d lloyd_i / d c_{i+1}
    ab[1] = diag
    ab[2, :-1] = lo / 2  # d lloyd_{i+1} / d c_i
    return c - solve_banded((1, 1), ab, mapped - c)


def solve(d: int, bits: int, tol: float = 1e-11) -> np.ndarray:
    """Lloyd-Max centroids for f_d with ``2**bits`` levels (float64, ascending).

    Starts from the high-resolution optimum (centroid density ∝ f_d^(1/3), which for f_d is again a symmetric
    Beta law). Plain Lloyd iteration converges linearly and very slowly at 6-8 bits, so each step tries Newton's
    method on the fixed-point equation (tridiagonal Jacobian) and keeps it only when it stays ordered and shrinks
    the residual; otherwise it takes the Lloyd step. Only the upper half is trusted (tail probabilities are exact
    there) and mirrored, which keeps the codebook exactly symmetric.
    """
    from scipy.special import betaincinv

    if d < 2:
        raise ValueError(f"head_dim={d}: a unit-vector coordinate codebook needs d >= 2")
    if not 0 <= bits <= 8:
        raise ValueError(f"codebook bits={bits} is out of range; allowed: 0 <= bits <= 8")
    k = 1 << bits
    if k == 1:
        return np.zeros(1)
    a3 = (d - 3) / 6 + 1  # f_d^(1/3) ∝ (1 - t²)^((d-3)/6): Beta(a3, a3) after t -> (t + 1)/2
    c = 2 * betaincinv(a3, a3, (np.arange(k) + 0.5) / k) - 1
    scale = 1 / math.sqrt(d)
    for _ in range(_MAX_ITER):
        mapped, p, edges = _lloyd_map(d, c)
        res = np.max(np.abs(mapped - c))
        if res < tol * scale:
            return mapped
        cand = _newton_step(d, c, mapped, p, edges)
        cand = (cand - cand[::-1]) / 2
        if np.all(np.diff(cand) > 0) and -1 < cand[0] and np.max(np.abs(_lloyd_map(d, cand)[0] - cand)) < res:
            c = cand
        else:
            c = mapped
    raise RuntimeError(f"Lloyd iteration for d={d}, bits={bits} did not converge in {_MAX_ITER} steps")


@functools.cache
def codebook(d: int, bits: int) -> SphereCodebook:
    """The (d, bits) codebook: from memory, else from ``$KVBENCH_HOME/codebooks``, else solved and stored there."""
    d, bits = int(d), int(bits)
    path = home() / "codebooks" / f"sphere-v{_VERSION}-d{d}-b{bits}.npy"
    centroids = None
    if path.exists():
        try:
            loaded = np.load(path, allow_pickle=False)
            if loaded.shape == (1 << bits,) and loaded.dtype == np.float64 and np.all(np.isfinite(loaded)):
                centroids = loaded
        except (OSError, ValueError):
            centroids = None  # unreadable cache file: solve again and overwrite it
    if centroids is None:
        centroids = solve(d, bits)
        buf = io.BytesIO()
        np.save(buf, centroids, allow_pickle=False)
        try:
            write_bytes(path, buf.getvalue())
        except OSError:
            pass  # a read-only home only costs the solve next time
    centroids.setflags(write=False)
    return SphereCodebook(d, bits, centroids)
