"""The cpu adaptation list: each entry checks, applies and undoes cleanly, and refuses a changed target."""

from __future__ import annotations

import inspect

import pytest
import torch
from loongforge.accelerator.adaptation import AdaptationSet, resolve
from loongforge.errors import AdaptationError
from loongforge_megatron.device_adapters.cpu import TARGETS, cpu_adaptations

NAMES = [a.name for a in cpu_adaptations()]


def _raw(target: str):
    owner, attr = resolve(target)
    return owner.__dict__.get(attr, getattr(owner, attr)) if isinstance(owner, type) else getattr(owner, attr)


def _by_name(name: str):
    return next(a for a in cpu_adaptations() if a.name == name)


def test_names_are_unique() -> None:
    assert len(NAMES) == len(set(NAMES)) == len(TARGETS)
    assert set(NAMES) == set(TARGETS)


@pytest.mark.parametrize("name", NAMES)
def test_check_passes_on_installed_megatron(name: str) -> None:
    assert _by_name(name).check() is not False


@pytest.mark.parametrize("name", NAMES)
def test_apply_and_undo(name: str) -> None:
    target = TARGETS[name]
    before = _raw(target)
    undo = _by_name(name).apply()
    try:
        assert _raw(target) is not before
    finally:
        undo()
    assert _raw(target) is before


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("tensor-")])
def test_changed_target_fails_loudly(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A target whose source no longer has the CUDA assumption (an upgraded megatron) is refused."""
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: "def changed():\n    return 1\n")
    with pytest.raises(AdaptationError, match=name):
        _by_name(name).check()
    monkeypatch.setattr(inspect, "getsource", real)


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("cuda-devices:")])
def test_replaced_function_fails_loudly(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same, with the target really replaced by a function that has no CUDA code."""
    owner, attr = resolve(TARGETS[name])

    def changed(*args, **kwargs):
        return None

    monkeypatch.setattr(owner, attr, classmethod(changed) if name == "distopt-param-types" else changed)
    with pytest.raises(AdaptationError):
        _by_name(name).check()


def test_missing_target_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    owner, attr = resolve(TARGETS["grad-norm"])
    monkeypatch.delattr(owner, attr)
    with pytest.raises(AdaptationError, match="no longer exists"):
        _by_name("grad-norm").check()


def test_set_applies_everything_and_restores_everything() -> None:
    before = {name: _raw(t) for name, t in TARGETS.items()}
    type_before, cuda_before = torch.Tensor.type, torch.Tensor.cuda
    with AdaptationSet(cpu_adaptations()):
        from megatron.core.pipeline_parallel import schedules

        assert schedules.torch.zeros(2, device="cuda").device.type == "cpu"
        assert all(_raw(t) is not before[n] for n, t in TARGETS.items())
    assert all(_raw(t) is before[n] for n, t in TARGETS.items())
    assert torch.Tensor.type is type_before and torch.Tensor.cuda is cuda_before
