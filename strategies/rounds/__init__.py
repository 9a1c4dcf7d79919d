"""The phases of a horizontal round, each a small class with its own contract, composed by
:class:`strategies.horizontal.SurvivalFedAvg`'s round loop.

* configure: Flower's ``FedAvg.configure_train``/``configure_evaluate`` (sampling, the model and config);
* screen replies (:mod:`~strategies.rounds.screening`): :class:`~strategies.rounds.screening.ReplyScreen` files every
  error, missing, mislabelled or oversized reply of any phase as a named failure;
  :class:`~strategies.rounds.screening.TrainScreen` checks each training reply and sets its weight;
* aggregate (:mod:`~strategies.rounds.aggregation`): one :class:`~strategies.rounds.aggregation.TrainingRelease` a
  run, :class:`~strategies.rounds.aggregation.PlainRelease` (each reply read, combined by
  :class:`~strategies.rounds.aggregation.UpdateAggregation`) or
  :class:`~strategies.rounds.secure_sum.SecureSumRelease` (only the sites' sum unmasked);
* Breslow/recalibration (:mod:`~strategies.rounds.baseline`): what the evaluation message carries;
* evaluation (:mod:`~strategies.rounds.evaluation`): the sites' test metrics screened and pooled, and the model kept
  (a diverged model rolled back, the running average); where the next round's training message carries the round's
  model, it asks for those metrics (or a Cox-type model's Breslow sums) too (:mod:`~strategies.rounds.carried`);
* ledger (:mod:`~strategies.rounds.ledger`): the round records, who released what, each site's privacy position.

:mod:`~strategies.rounds.records` holds the message keys, the round record and the readers of a reply;
:mod:`~strategies.rounds.robust` the arithmetic of the weighted mean, centred clipping and the robust aggregators.
"""
