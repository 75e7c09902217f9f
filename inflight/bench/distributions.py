"""Length and arrival distributions of a workload spec, sampled with the workload's own RNG.

Each model is a pydantic record read from YAML, discriminated by `kind`. A length may also be
written as a bare integer (`output_len: 128` is `{kind: fixed, value: 128}`). Every length
distribution is rounded to integers and clipped to `[min, max]`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


class SpecModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- lengths ------------------------------------------------------------------------------------


class _Length(SpecModel):
    min: int = Field(1, ge=1, description="clip: no sample below this")
    max: int | None = Field(None, ge=1, description="clip: no sample above this")
    weight: float = Field(1.0, gt=0, description="share of this component inside a mixture")

    @model_validator(mode="after")
    def _check_range(self) -> _Length:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` integer lengths, rounded and clipped to [min, max]."""
        upper = self.max if self.max is not None else np.iinfo(np.int64).max
        return np.clip(np.rint(self._draw(rng, n)), self.min, upper).astype(np.int64)

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError


class FixedLength(_Length):
    kind: Literal["fixed"]
    value: int = Field(ge=1)

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value)


class UniformLength(_Length):
    """Integers drawn uniformly from [min, max], both included."""

    kind: Literal["uniform"]
    max: int = Field(ge=1)

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.min, self.max, size=n, endpoint=True)


class NormalLength(_Length):
    kind: Literal["normal"]
    mean: float = Field(gt=0)
    std: float = Field(ge=0)

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.normal(self.mean, self.std, size=n)


class LogNormalLength(_Length):
    """Heavy right tail; `mean` and `std` are those of the lengths themselves (before clipping),
    not of their logarithm."""

    kind: Literal["lognormal"]
    mean: float = Field(gt=0)
    std: float = Field(gt=0)

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        sigma2 = np.log1p((self.std / self.mean) ** 2)
        return rng.lognormal(np.log(self.mean) - sigma2 / 2, np.sqrt(sigma2), size=n)


class MixtureLength(_Length):
    """Each sample comes from one component, picked with probability proportional to its weight
    (e.g. most outputs short, a tail very long)."""

    kind: Literal["mixture"]
    components: list[LengthDist] = Field(min_length=1)

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        weights = np.array([c.weight for c in self.components], dtype=float)
        picks = rng.choice(len(self.components), size=n, p=weights / weights.sum())
        out = np.empty(n, dtype=np.int64)
        for i, component in enumerate(self.components):
            mask = picks == i
            out[mask] = component.sample(rng, int(mask.sum()))
        return out


def _int_is_fixed(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return {"kind": "fixed", "value": value}
    return value


LengthDist = Annotated[
    FixedLength | UniformLength | NormalLength | LogNormalLength | MixtureLength,
    Field(discriminator="kind"),
    BeforeValidator(_int_is_fixed),
]
MixtureLength.model_rebuild()


# --- arrivals -----------------------------------------------------------------------------------


class BurstArrivals(SpecModel):
    """Every request at t=0: offline throughput."""

    kind: Literal["burst"]

    def offsets(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.zeros(n)


class PoissonArrivals(SpecModel):
    """Exponential gaps with mean 1/rate."""

    kind: Literal["poisson"]
    rate: float = Field(gt=0, description="requests per second")

    def offsets(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return _from_gaps(rng.exponential(1.0 / self.rate, size=n))


class GammaArrivals(SpecModel):
    """Gamma-distributed gaps with mean 1/rate. `burstiness` is the shape: 1 is Poisson,
    below 1 burstier (clumps and lulls), above 1 more regular."""

    kind: Literal["gamma"]
    rate: float = Field(gt=0, description="requests per second")
    burstiness: float = Field(1.0, gt=0)

    def offsets(self, rng: np.random.Generator, n: int) -> np.ndarray:
        scale = 1.0 / (self.rate * self.burstiness)
        return _from_gaps(rng.gamma(self.burstiness, scale, size=n))


class TraceArrivals(SpecModel):
    """Arrival times and lengths replayed from a file (CSV with a header, or JSONL) with the
    columns `timestamp` (seconds), `prompt_len`, `output_len`. A relative path is taken from the
    spec file's folder. Timestamps are shifted so the first request arrives at t=0."""

    kind: Literal["trace"]
    path: str
    time_scale: float = Field(1.0, gt=0, description="multiply gaps by this (0.5 = twice as fast)")


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    """Offsets from gaps, with the first request at t=0."""
    offsets = np.cumsum(gaps)
    return offsets - offsets[0] if len(offsets) else offsets


Arrivals = Annotated[
    BurstArrivals | PoissonArrivals | GammaArrivals | TraceArrivals,
    Field(discriminator="kind"),
]
