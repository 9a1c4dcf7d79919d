"""Shared test set-up."""

import numpy as np
import scipy.integrate

# pycox 0.3.0 (used here only as a reference implementation) calls scipy.integrate.simps,
# removed in SciPy 1.14; give it simpson with simps' positional (y, x) signature.
if not hasattr(scipy.integrate, "simps"):

    def _simps(y: np.ndarray, x: np.ndarray | None = None, dx: float = 1.0, axis: int = -1) -> float:
        return scipy.integrate.simpson(y, x=x, dx=dx, axis=axis)

    scipy.integrate.simps = _simps
