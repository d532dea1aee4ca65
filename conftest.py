"""Workspace-wide test plugins (tests/support/): the multi-process harness (``ranks``, ``free_port``) and
``--test-order reverse|shuffle``."""

pytest_plugins = ["rank_harness", "run_order"]
