r"""Feature-reconstruction attack on split-learning embeddings (BVFLMSP's audit).

The server sees each site's (noisy) embedding of every record. If it also holds an auxiliary set
of records with both features and embeddings (a public split, or records it obtained otherwise),
it can fit a decoder from embedding to features and apply it to everyone else's embeddings.
:func:`reconstruction_attack` does exactly that and reports the out-of-sample coefficient of
determination per feature,

.. math::

    R^2_j = 1 - \frac{\sum_i (x_{ij} - \hat x_{ij})^2}{\sum_i (x_{ij} - \bar x_j)^2},

on the target records (``\bar x_j`` their mean). ``R² ≈ 0`` means the decoder does no better
than guessing the mean; 1 is perfect reconstruction; negative values are worse than the mean.
The decoder is a ridge regression (closed form, cross-validated penalty) or a small MLP;
either is a lower bound on what a stronger attacker could do, so a low R² is evidence, not proof,
of protection — the DP guarantee is the proof.

References
----------
BVFLMSP paper (Kar, Saha, Sen & Pradhan, arXiv:2604.02248, 2026), §7 (feature
reconstruction from embeddings); He, Zhang & Lee, "Model inversion attacks against
collaborative inference", ACSAC 2019.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.linear_model import RidgeCV
from sklearn.neural_network import MLPRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from strategies.validation import check_choice

__all__ = ["DECODERS", "ReconstructionResult", "reconstruction_attack"]

DECODERS = ("ridge", "mlp")


@dataclass(frozen=True)
class ReconstructionResult:
    """Out-of-sample reconstruction quality.

    Attributes
    ----------
    r2_per_feature : numpy.ndarray, shape (p,)
        ``R²_j`` on the target records (NaN for a feature constant on them).
    r2 : float
        Mean of the finite ``R²_j``: the headline figure.
    decoder : str
    """

    r2_per_feature: np.ndarray
    r2: float
    decoder: str


def reconstruction_attack(
    auxiliary_embeddings: np.ndarray,
    auxiliary_features: np.ndarray,
    target_embeddings: np.ndarray,
    target_features: np.ndarray,
    *,
    decoder: str = "ridge",
    seed: int = 0,
) -> ReconstructionResult:
    """Fit embedding → features on the auxiliary records; score it on the target records.

    Parameters
    ----------
    auxiliary_embeddings, target_embeddings : ndarray, shape (n, d)
        What the server received (after the site's clipping and noise).
    auxiliary_features, target_features : ndarray, shape (n, p)
        The site's true features of the same records (the attacker knows the auxiliary ones;
        the target ones are only used to score the attack).
    decoder : {"ridge", "mlp"}
        Ridge regression with the penalty chosen by leave-one-out CV over 13 values in
        ``[1e-6, 1e6]``, or a one-hidden-layer MLP (128 units, early stopping); both on
        standardised embeddings.
    seed : int
        Seed of the MLP.

    Returns
    -------
    ReconstructionResult
    """
    decoder = check_choice(decoder, DECODERS, "decoder")
    arrays = [np.asarray(a, dtype=np.float64) for a in
              (auxiliary_embeddings, auxiliary_features, target_embeddings, target_features)]
    aux_e, aux_x, target_e, target_x = (a.reshape(len(a), -1) for a in arrays)
    if len(aux_e) != len(aux_x) or len(target_e) != len(target_x):
        raise ValueError("embeddings and features must have one row per record")
    if aux_e.shape[1] != target_e.shape[1] or aux_x.shape[1] != target_x.shape[1]:
        raise ValueError("auxiliary and target parts must have the same embedding and feature widths")
    if len(aux_e) < 2 or len(target_e) < 2:
        raise ValueError("need at least 2 auxiliary and 2 target records")
    if not all(np.all(np.isfinite(a)) for a in (aux_e, aux_x, target_e, target_x)):
        raise ValueError("embeddings and features must be finite")
    if decoder == "ridge":
        model = make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-6, 6, 13)))
    else:
        model = make_pipeline(StandardScaler(), MLPRegressor(hidden_layer_sizes=(128,), early_stopping=True,
                                                             max_iter=500, random_state=seed))
    model.fit(aux_e, aux_x if aux_x.shape[1] > 1 else aux_x.ravel())
    predicted = np.asarray(model.predict(target_e), dtype=np.float64).reshape(len(target_x), -1)
    residual = np.sum((target_x - predicted) ** 2, axis=0)
    spread = np.sum((target_x - target_x.mean(axis=0)) ** 2, axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        r2 = np.where(spread > 0, 1.0 - residual / spread, np.nan)
    finite = r2[np.isfinite(r2)]
    return ReconstructionResult(r2_per_feature=r2, r2=float(finite.mean()) if finite.size else float("nan"),
                                decoder=decoder)
