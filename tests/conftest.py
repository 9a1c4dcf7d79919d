"""Shared test set-up."""

import numpy as np
import pytest
import scipy.integrate

# pycox 0.3.0 (used here only as a reference implementation) calls scipy.integrate.simps,
# removed in SciPy 1.14; give it simpson with simps' positional (y, x) signature.
if not hasattr(scipy.integrate, "simps"):

    def _simps(y: np.ndarray, x: np.ndarray | None = None, dx: float = 1.0, axis: int = -1) -> float:
        return scipy.integrate.simpson(y, x=x, dx=dx, axis=axis)

    scipy.integrate.simps = _simps


@pytest.fixture(autouse=True)
def _site_state_home(tmp_path_factory, monkeypatch):
    """A deployed site without node config ``site-dir`` keeps its secret under ``$XDG_STATE_HOME``
    (:func:`flwr_app.site_store.site_dir`): a test's own folder, never the home directory."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
