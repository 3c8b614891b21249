"""Ranks: cross-rank outlier detection and the per-rank health ledger (which rank is the
culprit)."""
