"""Empirical privacy audits: attacks run against what a mechanism releases."""
