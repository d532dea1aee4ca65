"""megatron-core's model-parallel RNG tracker, on the CPU generator.

megatron keeps named RNG states (data-parallel, tensor-parallel, expert-parallel) and swaps them into the
*CUDA* generator around dropout and weight initialisation. On the CPU there is one generator, so the tracker
swaps the CPU generator's state instead. Same seeds, same bookkeeping, same nesting rules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def get_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU replacement of ``tensor_parallel.random._get_cuda_rng_state`` (used by activation recompute)."""
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """CPU replacement of ``tensor_parallel.random._set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


def cpu_tracker_class(base: type) -> type:
    """A subclass of megatron's ``CudaRNGStatesTracker`` whose states live in the CPU generator.

    NOTE: built from the class being replaced (not imported at module level) so that importing this package
    never imports megatron-core, and so that ``isinstance(tracker, CudaRNGStatesTracker)`` stays true.
    """

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Tracks named CPU RNG states the way megatron tracks CUDA ones."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig = self.states_[orig_name]
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    CpuRNGStatesTracker.__qualname__ = "CpuRNGStatesTracker"
    return CpuRNGStatesTracker
