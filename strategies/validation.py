"""Argument checks shared by the accountants and the privacy mechanisms.

Each check returns the value converted to its plain Python type, or raises with the argument's
name. :func:`is_tensor` lets the pure functions take numpy arrays or torch tensors without
importing torch.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np


def check_positive(value: float, name: str) -> float:
    """A finite number > 0."""
    checked = float(value)
    if not math.isfinite(checked) or checked <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return checked


def check_probability(value: float, name: str) -> float:
    """A number in the open interval (0, 1) (δ, β, γ)."""
    checked = float(value)
    if not math.isfinite(checked) or not 0.0 < checked < 1.0:
        raise ValueError(f"{name} must lie in (0, 1), got {value!r}")
    return checked


def check_sample_rate(value: float) -> float:
    """A sampling probability in (0, 1]."""
    checked = float(value)
    if not math.isfinite(checked) or not 0.0 < checked <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1], got {value!r}")
    return checked


def check_count(value: int, name: str, *, minimum: int = 1) -> int:
    """An integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_choice(value: str, options: Sequence[str], name: str) -> str:
    """One of ``options`` (an adjacency, a dispersion measure, ...)."""
    if value not in options:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
    return value


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Tensor``, without importing torch (no tensor exists before torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)
