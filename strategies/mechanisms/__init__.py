"""Privacy mechanisms: one module, and one object, per mechanism.

:mod:`strategies.mechanisms.registry` maps each ``strategy.name`` to its
:class:`~strategies.mechanisms.base.Mechanism` (checks, site step, accounting, ledger entry,
assumptions, release manifest): :mod:`~strategies.mechanisms.none` (``fedavg``),
:mod:`~strategies.mechanisms.dp_sgd`, :mod:`~strategies.mechanisms.bdp`,
:mod:`~strategies.mechanisms.central_dp`, :mod:`~strategies.mechanisms.nbafl` (``nbafl``,
``ls_adp``, ``row_dp``) and :mod:`~strategies.mechanisms.embedding_dp` (``split``). The pure
mathematics lives beside each object in its module (and in :mod:`strategies.accounting`); these
modules import no torch, opacus or Flower, so parsing a run configuration (which runs the
mechanism's checks) stays light. The site's numerics live in sibling modules imported only where
they run: :mod:`~strategies.mechanisms.dp_sgd_training` (per-sample gradients, clipping, noise,
the DP-SGD loop), :mod:`~strategies.mechanisms.bdp_training` (the Bayesian accountant's budget
filter around that loop), :mod:`~strategies.mechanisms.weight_release` (NbAFL / LS-ADP / ROW-DP
weight perturbation) and :mod:`~strategies.mechanisms.embedding_noise` (split learning's
embedding clip and noise). :mod:`~strategies.mechanisms.setup_statistics` releases a
federation's set-up with DP.
"""
