"""Privacy mechanisms: one module, and one object, per mechanism.

:mod:`strategies.mechanisms.registry` maps each ``strategy.name`` to its
:class:`~strategies.mechanisms.base.Mechanism`, an object made of small roles (its checks, what a
site runs, what the server verifies and does, what the ledger states: :mod:`~strategies.mechanisms.base`):
:mod:`~strategies.mechanisms.none` (``fedavg``), :mod:`~strategies.mechanisms.dp_sgd`,
:mod:`~strategies.mechanisms.bdp`, :mod:`~strategies.mechanisms.distributed_dp`,
:mod:`~strategies.mechanisms.central_dp`, :mod:`~strategies.mechanisms.nbafl` (``nbafl``, ``ls_adp``,
``row_dp``, one class each), :mod:`~strategies.mechanisms.embedding_dp` (``split``) and
:mod:`~strategies.mechanisms.private_split`. What they share lives in modules that import no
mechanism: the keys each honours (:mod:`~strategies.mechanisms.keys`), the release manifest and the
ledger's common sentences (:mod:`~strategies.mechanisms.manifest`), the private set-up's noise
(:mod:`~strategies.mechanisms.setup_share`) and the schedules, calibrations and constants a mechanism
object and its site's numerics agree on (:mod:`~strategies.mechanisms.schedules`). The pure
mathematics lives beside each object in its module (and in :mod:`strategies.accounting`); these
modules import no torch, opacus or Flower, so parsing a run configuration (which runs the
mechanism's checks) stays light. The site's numerics live in sibling modules imported only where
they run: :mod:`~strategies.mechanisms.dp_sgd_training` (per-sample gradients, clipping, noise,
the DP-SGD loop), :mod:`~strategies.mechanisms.bdp_training` (the Bayesian accountant's budget
filter around that loop), :mod:`~strategies.mechanisms.distributed_dp_training` (a site's rounded
gradient sum and its discrete Gaussian share), :mod:`~strategies.mechanisms.weight_release` (NbAFL /
LS-ADP / ROW-DP weight perturbation) and :mod:`~strategies.mechanisms.embedding_noise` (split
learning's embedding clip and noise). :mod:`~strategies.mechanisms.setup_statistics` releases a
federation's set-up with DP. No module of this package imports another in a circle.
"""
