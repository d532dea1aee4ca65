"""Workspace-wide test plugins: the multi-process harness (``ranks``, ``free_port``) in tests/support/."""

pytest_plugins = ["rank_harness"]
