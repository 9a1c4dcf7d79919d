"""The paper reproductions and the research grids behind docs/results.md: not part of the product.

Each module reruns or re-tabulates one published comparison (LS-ADP/ROW-DP: :mod:`.adaptive_dp`;
FSL-BDP: :mod:`.fsl_bdp`; BVFLMSP: :mod:`.table1`, :mod:`.bvflmsp`, :mod:`.uncertainty`), the
membership-inference audits (:mod:`.membership`), the measured trade-offs of docs/when-to-use-what.md
(:mod:`.tradeoffs`), or regenerates docs/results.md from the latest saved run of each reproduction
(:mod:`.report`). They run from a source checkout (``python -m simulations.papers.<module>``) and are
left out of the wheel (pyproject.toml: ``[tool.hatch.build.targets.wheel] exclude``); nothing in
``fedsurv``, ``flwr_app``, ``strategies``, ``models`` or the rest of ``simulations`` imports them.
"""
