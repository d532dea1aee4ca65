"""Engine tests use the ``ranks`` fixture of the workspace harness (tests/support/rank_harness.py)."""
