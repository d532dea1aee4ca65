"""The ``kunlun`` accelerator against the simulated runtime: selection, collectives naming, devices, RNG."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from loongforge.accelerator import get_accelerator
from loongforge.errors import PluginError
from loongforge_xpu import KunlunAccelerator


def test_selected_by_name_through_the_entry_point(simulated_runtime):
    acc = get_accelerator("kunlun")
    assert isinstance(acc, KunlunAccelerator)
    assert "torch_xmlir" not in sys.modules, "detection must not import the runtime (it reads XMLIR_* at import)"


def test_missing_runtime_is_one_clear_line():
    reason = KunlunAccelerator.unavailable_reason()
    assert reason is not None and "torch_xmlir" in reason and "\n" not in reason
    with pytest.raises(PluginError, match="accelerator 'kunlun' is not available: .*torch_xmlir"):
        get_accelerator("kunlun")


def test_environment_is_exported_before_the_runtime_is_imported(simulated_runtime):
    acc = get_accelerator("kunlun", env={"BKCL_PCIE_RING": "1", "XMLIR_D_XPU_L3_SIZE": "1024"})
    acc.setup_environment()
    import torch_xmlir

    assert torch_xmlir.IMPORT_ENV["BKCL_PCIE_RING"] == "1"
    assert torch_xmlir.IMPORT_ENV["XMLIR_D_XPU_L3_SIZE"] == "1024"
    assert torch_xmlir.IMPORT_ENV["XMLIR_F_XPU_ENABLED_BOOL"] == "true"  # a documented default


def test_recipe_beats_process_environment_beats_defaults(simulated_runtime, monkeypatch):
    monkeypatch.setenv("XMLIR_TORCH_XCCL_ENABLED", "false")
    monkeypatch.setenv("BKCL_FORCE_SYNC", "0")
    get_accelerator("kunlun", env={"BKCL_FORCE_SYNC": "1"}).setup_environment()
    assert os.environ["XMLIR_TORCH_XCCL_ENABLED"] == "false"
    assert os.environ["BKCL_FORCE_SYNC"] == "1"
    assert os.environ["XMLIR_F_XPU_ENABLED_BOOL"] == "true"


def test_collective_backend_is_the_registered_bkcl_group(simulated_runtime):
    acc = get_accelerator("kunlun")
    acc.setup_environment()
    assert acc.dist_backend == "kccl"
    assert "kccl" in acc.describe()


def test_legacy_bkcl_group_name(simulated_runtime):
    acc = get_accelerator("kunlun", env={"XMLIR_ENABLE_NEW_PG": "0"})
    acc.setup_environment()
    assert acc.dist_backend == "bccl"


def test_dist_backend_option_overrides(simulated_runtime):
    assert get_accelerator("kunlun", options={"dist_backend": "nccl"}).dist_backend == "nccl"


def test_bkcl_process_group_runs_collectives(simulated_runtime, monkeypatch):
    import torch.distributed as dist
    from loongforge.runtime import free_port

    acc = get_accelerator("kunlun")
    acc.setup_environment()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group(backend=acc.dist_backend, rank=0, world_size=1)
    try:
        assert dist.get_backend() == "kccl"
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_devices_go_through_the_runtime(simulated_runtime, monkeypatch):
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "4,5")
    acc = get_accelerator("kunlun")
    acc.setup_environment()
    assert acc.device_type == "cpu" and acc.device() == torch.device("cpu")
    assert acc.device_count() == 2
    acc.set_device(3)
    assert acc.current_device_index() == 1
    acc.synchronize()
    assert set(acc.memory_stats()) >= {"allocated", "peak_allocated"}


def test_no_visible_device_is_one_clear_line(simulated_runtime, monkeypatch):
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "")
    acc = get_accelerator("kunlun")
    with pytest.raises(PluginError, match="no Kunlun XPU is visible"):
        acc.setup_environment()


def test_rng_seeds_and_restores_the_device_generator(simulated_runtime):
    import torch_xmlir

    acc = get_accelerator("kunlun")
    acc.manual_seed(11)
    assert torch_xmlir.DEVICE.seeded[-1] == 11
    state = acc.get_rng_state()
    assert set(state) == {"cpu", "kunlun"}
    a = torch.rand(4)
    acc.set_rng_state(state)
    assert torch.equal(a, torch.rand(4))


def test_capabilities_and_precision(simulated_runtime):
    acc = get_accelerator("kunlun", options={"peak_tflops": 100})
    caps = acc.capabilities()
    assert caps.triton is False and caps.fp8 is False and caps.bf16 is True
    assert caps.extra["runtime"] == "torch_xmlir" and caps.extra["version"] == "0.0.0+simulated"
    assert acc.resolve_precision("auto") == "fp32"  # the simulation is a CPU device
    assert acc.peak_flops(torch.bfloat16) == 100e12


def test_peak_flops_from_the_device_name(simulated_runtime):
    acc = get_accelerator("kunlun")
    assert acc.peak_flops(torch.float16) == 128e12  # "Kunlun R300 (simulated)"
    assert acc.peak_flops(torch.float32) is None


def test_megatron_adaptations_in_simulation_are_the_cpu_ones(simulated_runtime):
    from loongforge_megatron.device_adapters import adapted

    acc = get_accelerator("kunlun")
    acc.setup_environment()
    assert list(acc.adaptations("megatron")) == []
    assert acc.adaptations("embodied") == ()
    assert "rng-tracker" in adapted(acc).names  # the megatron backend's CPU list, through the same door
