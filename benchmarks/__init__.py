"""Benchmarks of fedsurv (each a script: ``python benchmarks/<name>.py``).

A package so that tests import this folder, not the ``benchmarks`` package that opacus installs.
"""
