"""Parallel layouts: resolve a recipe's ``parallel`` section into a validated :class:`ParallelPlan`."""

from loongforge.parallel.plan import ParallelPlan, resolve_plan

__all__ = ["ParallelPlan", "resolve_plan"]
