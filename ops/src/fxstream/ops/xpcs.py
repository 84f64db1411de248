"""XPCS in numpy: a simulated area detector's speckle frames, and their two-time analysis.

The beamline demo (``./fx demo beamline``, :mod:`fxstream.ops.demo_beamline`) writes frame
stacks made by :func:`simulate_frames` and runs :func:`analyse_frames_file` on an endpoint
for each one. Both are plain numpy; the analysis reaches nothing else of this package, so
the SDK's default code strategy copies it (and the helpers it calls) by value and a worker
needs only numpy.

**The simulation.** A ``size x size`` detector (64 x 64 by default) looks at a sample
whose scatterers diffuse. The direct beam hits the centre, behind a beamstop of radius
:data:`BEAMSTOP_PX` pixels; a pixel's distance ``r`` from the centre stands for the
momentum transfer ``q``. The mean intensity falls off as an Ornstein-Zernike profile
``S(r) = peak / (1 + (r / r_c)^2)``. Each pixel sees a speckle: ``modes`` independent
complex Gaussian fields (partial coherence: speckle contrast ``beta = 1 / modes``), each an
Ornstein-Uhlenbeck process in time whose correlation decays as ``exp(-lag / (2 tau(r)))``,
so that (Siegert) the intensity's is ``g2(lag) = 1 + beta exp(-lag / tau(r))``. Diffusion
makes ``tau(r) = tau_ref (r_ref / r)^2`` (``Gamma = D q^2``). The counts are Poisson draws of
the intensity (``uint16``). :meth:`SimulatedSample.expected_fit` says what the analysis
should find for a sample: a ring mixes pixels of different brightness and ``tau``.

**The analysis** (per q-ring of :data:`RINGS`): the two-time correlation
``C(t1, t2) = <I(t1) I(t2)>_ring / (<I(t1)>_ring <I(t2)>_ring)``, its time average along
each diagonal (the one-time ``g2(lag)``), and a least-squares fit of
``log(g2 - 1) = log(beta) - lag / tau`` over the lags where ``g2 - 1`` is still above a
fifth of its first value. The two-time's halves (``t1`` in the first or the second half of
the stack) give ``g2(1)`` twice: equal for a sample in equilibrium, apart for an ageing one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "BEAMSTOP_PX",
    "RINGS",
    "SimulatedSample",
    "analyse_frames",
    "analyse_frames_file",
    "fit_g2",
    "g2_from_two_time",
    "ring_masks",
    "simulate_frames",
    "two_time_correlation",
]

BEAMSTOP_PX: Final = 8
RINGS: Final = ((8, 12), (12, 17), (17, 22), (22, 28))
"""The q-rings, as ``[inner, outer)`` pixel radii from the beam centre."""

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class SimulatedSample:
    """What :func:`simulate_frames` simulates (and so what the analysis should find).

    ``tau_ref`` is the intensity relaxation time, in frames, at radius ``r_ref`` pixels;
    ``peak`` the mean counts at the centre of the profile, ``r_c`` its width in pixels;
    ``modes`` the coherent modes summed per pixel (speckle contrast ``1 / modes``).
    """

    size: int = 64
    tau_ref: float = 16.0
    r_ref: float = 10.0
    peak: float = 400.0
    r_c: float = 8.0
    modes: int = 2

    def __post_init__(self) -> None:
        positive = min(self.tau_ref, self.r_ref, self.peak, self.r_c) > 0
        if self.size < 2 * RINGS[-1][1] or not positive or self.modes < 1:
            raise ValueError(
                f"a sample needs size >= {2 * RINGS[-1][1]}, positive tau_ref, r_ref, peak "
                "and r_c, and at least one mode"
            )

    @property
    def beta(self) -> float:
        """The speckle contrast: ``g2(0+) - 1``."""
        return 1.0 / self.modes

    def tau(self, r: FloatArray | float) -> Any:
        """The intensity relaxation time (frames) at radius ``r`` (pixels): diffusion."""
        return self.tau_ref * (self.r_ref / np.maximum(r, 0.5)) ** 2

    def ring_tau(self) -> list[float]:
        """The relaxation time at each ring's middle radius, frames."""
        return [float(self.tau((lo + hi) / 2)) for lo, hi in RINGS]

    def expected_g2(self, lags: int) -> list[FloatArray]:
        """Per ring, the ``g2(0 .. lags)`` the two-time analysis converges to for this
        sample (noise-free: many frames and speckles).

        A ring mixes pixels of different mean counts ``m`` and times ``tau``, so its
        ``g2(lag) = <m^2> / <m>^2 (1 + beta <m^2 exp(-lag / tau)> / <m^2>)``: brighter
        (inner) pixels weigh more, and the ring's decay is not its middle radius's.
        """
        r = _radii(self.size)
        mean = self.mean_counts(r)
        tau = self.tau(r)
        steps = np.arange(lags + 1, dtype=np.float64)
        curves = []
        for mask in ring_masks(self.size):
            m, t = mean[mask], tau[mask]
            weight = m**2 / (m**2).sum()
            decay = (weight[None, :] * np.exp(-steps[:, None] / t[None, :])).sum(axis=1)
            spread = (m**2).mean() / m.mean() ** 2
            curves.append(spread * (1.0 + self.beta * decay))
        return curves

    def expected_fit(self, lags: int = 100) -> list[tuple[float | None, float | None]]:
        """Per ring, :func:`fit_g2` of :meth:`expected_g2`: the ``(beta, tau)`` the
        analysis should find."""
        return [fit_g2(curve) for curve in self.expected_g2(lags)]

    def expected_mean_intensity(self) -> float:
        """The mean counts per pixel and frame outside the beamstop."""
        r = _radii(self.size)
        return float(self.mean_counts(r)[r >= BEAMSTOP_PX].mean())

    def mean_counts(self, r: FloatArray) -> FloatArray:
        """The mean counts of a pixel at radius ``r`` (0 behind the beamstop)."""
        profile: FloatArray = self.peak / (1.0 + (r / self.r_c) ** 2)
        return np.where(r < BEAMSTOP_PX, 0.0, profile)


def _radii(size: int) -> FloatArray:
    centre = (size - 1) / 2
    y, x = np.indices((size, size), dtype=np.float64)
    radii: FloatArray = np.hypot(y - centre, x - centre)
    return radii


def simulate_frames(
    frames: int, sample: SimulatedSample, rng: np.random.Generator
) -> npt.NDArray[np.uint16]:
    """A stack of ``frames`` detector frames (``frames x size x size``, counts, ``uint16``)."""
    if frames < 2:
        raise ValueError(f"a stack needs at least 2 frames, not {frames}")
    size = sample.size
    r = _radii(size)
    # The field's correlation decays at half the intensity's rate (Siegert relation).
    a = np.exp(-1.0 / (2.0 * sample.tau(r)))
    kick = np.sqrt(1.0 - a**2)
    mean = sample.mean_counts(r)
    shape = (frames, sample.modes, size, size)

    def gaussian() -> npt.NDArray[np.complex128]:
        draw: npt.NDArray[np.complex128] = (
            rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
        ) / np.sqrt(2.0)
        return draw

    noise = gaussian()
    field = noise[0]
    speckle = np.empty((frames, size, size), dtype=np.float64)
    for t in range(frames):
        if t:
            field = a * field + kick * noise[t]
        speckle[t] = (np.abs(field) ** 2).mean(axis=0)
    counts = rng.poisson(mean * speckle)
    return np.minimum(counts, np.iinfo(np.uint16).max).astype(np.uint16)


def ring_masks(size: int) -> list[npt.NDArray[np.bool_]]:
    """One boolean mask per ring of :data:`RINGS` on a ``size x size`` detector."""
    r = _radii(size)
    return [(r >= lo) & (r < hi) for lo, hi in RINGS]


def two_time_correlation(frames: npt.NDArray[Any], mask: npt.NDArray[np.bool_]) -> FloatArray:
    """``C(t1, t2)`` of the pixels in ``mask``: ``frames x frames``, symmetric."""
    intensity = frames[:, mask].astype(np.float64)
    pixels = intensity.shape[1]
    if pixels == 0:
        raise ValueError("the mask selects no pixel")
    mean = intensity.mean(axis=1)
    if not np.all(mean > 0):
        raise ValueError("a frame has no counts in the ring: nothing to correlate")
    correlation: FloatArray = (intensity @ intensity.T) / pixels / np.outer(mean, mean)
    return correlation


def g2_from_two_time(two_time: FloatArray, first: int = 0, last: int | None = None) -> FloatArray:
    """``g2(lag)`` for lags ``0 .. frames-1``: the mean of each diagonal of ``two_time``,
    over the ``t1`` in ``[first, last)`` (all by default) whose ``t1 + lag`` is a frame."""
    frames = two_time.shape[0]
    end = frames if last is None else last
    g2 = np.empty(frames, dtype=np.float64)
    for lag in range(frames):
        diagonal = np.diagonal(two_time, lag)[first:end]
        g2[lag] = diagonal.mean() if diagonal.size else np.nan
    return g2


def fit_g2(g2: FloatArray) -> tuple[float | None, float | None]:
    """``(beta, tau)`` of ``g2(lag) = 1 + beta exp(-lag / tau)``: a straight-line fit of
    ``log(g2 - 1)`` from lag 1 while ``g2 - 1`` stays above a fifth of ``g2(1) - 1``.

    ``(None, None)`` when fewer than two lags qualify (no decay to fit).
    """
    excess = g2[1:] - 1.0
    if excess.size < 2 or not excess[0] > 0:
        return None, None
    floor = excess[0] / 5.0
    used = 0
    while used < excess.size and excess[used] > floor:
        used += 1
    if used < 2:
        return None, None
    lags = np.arange(1, used + 1, dtype=np.float64)
    slope, intercept = np.polyfit(lags, np.log(excess[:used]), 1)
    if slope >= 0:
        return float(np.exp(intercept)), None
    return float(np.exp(intercept)), float(-1.0 / slope)


def analyse_frames(frames: npt.NDArray[Any], g2_lags: int = 20) -> dict[str, Any]:
    """The two-time analysis of one stack (``frames x ny x nx``): per ring of
    :data:`RINGS`, its pixels, mean counts, ``g2`` for lags ``0 .. g2_lags``, the fitted
    ``beta`` and ``tau`` (frames), and ``g2(1)`` over the first and second half of the
    stack; plus the stack's shape and mean counts outside the beamstop."""
    if frames.ndim != 3 or frames.shape[0] < 4:
        raise ValueError(f"a stack is frames x ny x nx with at least 4 frames, not {frames.shape}")
    count, ny, nx = frames.shape
    half = count // 2
    rings = []
    for (lo, hi), mask in zip(RINGS, ring_masks(min(ny, nx)), strict=True):
        two_time = two_time_correlation(frames, mask)
        g2 = g2_from_two_time(two_time)
        beta, tau = fit_g2(g2)
        early = g2_from_two_time(two_time, 0, half)
        late = g2_from_two_time(two_time, half)
        rings.append(
            {
                "r_px": [lo, hi],
                "pixels": int(mask.sum()),
                "mean_counts": round(float(frames[:, mask].mean()), 3),
                "g2": [round(float(v), 4) for v in g2[: g2_lags + 1]],
                "beta": None if beta is None else round(beta, 4),
                "tau_frames": None if tau is None else round(tau, 3),
                "g2_lag1_first_half": round(float(early[1]), 4),
                "g2_lag1_second_half": round(float(late[1]), 4),
            }
        )
    outside = _radii(min(ny, nx)) >= BEAMSTOP_PX
    return {
        "frames": int(count),
        "shape": [int(ny), int(nx)],
        "mean_intensity": round(float(frames[:, outside].mean()), 3),
        "rings": rings,
    }


def analyse_frames_file(event: dict[str, Any]) -> dict[str, Any]:
    """The beamline rule's function: load the ``.npy`` stack the file event names and
    return :func:`analyse_frames` of it, with the path, the event's time and the seconds
    the analysis took on the worker."""
    import time

    started = time.perf_counter()
    path = str(event["attributes"]["path"])
    frames = np.load(path, allow_pickle=False)
    answer = analyse_frames(frames)
    answer["path"] = path
    answer["event_at"] = event["occurred_at"]
    answer["analysis_s"] = round(time.perf_counter() - started, 4)
    return answer
