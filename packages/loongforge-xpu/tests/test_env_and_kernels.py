"""Recipe-visible XMLIR_* / BKCL_* validation, kernel overrides, and the megatron adaptation for real hardware."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongforge.accelerator import AdaptationSet, get_accelerator
from loongforge.errors import PluginError, RecipeError
from loongforge.kernels import select_op
from loongforge_xpu import env as kenv
from loongforge_xpu.megatron import TorchView, _DistributedView, megatron_adaptations


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"bkcl_pcie_ring": "1"}, "accelerator.env.bkcl_pcie_ring.*case-sensitive; use 'BKCL_PCIE_RING'"),
        ({"BKCL_PCIE_RNG": "1"}, "accelerator.env.BKCL_PCIE_RNG.*did you mean 'BKCL_PCIE_RING'"),
        ({"XMLIR_ENABLE_NEW_PGG": "1"}, "did you mean 'XMLIR_ENABLE_NEW_PG'"),
        ({"BKCL_PCIE_RING": "yes"}, "accelerator.env.BKCL_PCIE_RING.*expected 0 or 1, got 'yes'"),
        ({"XMLIR_F_XPU_ENABLED_BOOL": "on"}, "expected true or false"),
        ({"XMLIR_D_XPU_L3_SIZE": "64MB"}, "expected a non-negative integer"),
    ],
)
def test_certainly_wrong_variables_are_recipe_errors(env, match):
    with pytest.raises(RecipeError, match=match):
        kenv.validate_env(env)


def test_other_variables_pass_through():
    kenv.validate_env({"XMLIR_SOME_FUTURE_KNOB": "3", "BKCL_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "4",
                       "XMLIR_ENABLE_NEW_PG": "True", "BKCL_RDMA_NICS": "mlx5_1,mlx5_2"})


def test_unchecked_env_lets_a_lookalike_through(simulated_runtime):
    with pytest.raises(RecipeError):
        get_accelerator("kunlun", env={"BKCL_PCIE_RNG": "1"})
    get_accelerator("kunlun", env={"BKCL_PCIE_RNG": "1"}, options={"unchecked_env": ["BKCL_PCIE_RNG"]})


def test_unknown_option_names_the_key(simulated_runtime):
    with pytest.raises(RecipeError, match="accelerator.options.dist_backnd.*allowed: dist_backend"):
        get_accelerator("kunlun", options={"dist_backnd": "kccl"})


def test_readme_documents_every_known_variable():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert kenv.describe() in readme, "regenerate the table in README.md from loongforge_xpu.env.describe()"


OVERRIDES = {"kernel_overrides": {"rms_norm": "torch_xmlir.ops:rms_norm"}}


def test_plugin_kernel_override_wins(simulated_runtime):
    acc = get_accelerator("kunlun", options=OVERRIDES)
    acc.setup_environment()
    fn = select_op("rms_norm", provider="triton", device_type=acc.device_type, accelerator=acc)
    assert getattr(fn, "kunlun", False)


def test_explicit_provider_that_cannot_serve_raises(simulated_runtime):
    pytest.importorskip("loongforge_kernels")
    acc = get_accelerator("kunlun", options=OVERRIDES)
    acc.setup_environment()
    with pytest.raises(PluginError, match="kernel provider 'triton' needs Triton, which accelerator 'kunlun' lacks"):
        select_op("swiglu", provider="triton", device_type=acc.device_type, accelerator=acc)


def test_auto_falls_back_to_the_torch_reference(simulated_runtime):
    pytest.importorskip("loongforge_kernels")
    acc = get_accelerator("kunlun", options=OVERRIDES)
    acc.setup_environment()
    fn = select_op("swiglu", device_type=acc.device_type, accelerator=acc)
    assert fn.keywords.get("impl") == "torch"


def test_bad_override_target(simulated_runtime):
    with pytest.raises(RecipeError, match="kernel_overrides.rms_norm.*module:function"):
        get_accelerator("kunlun", options={"kernel_overrides": {"rms_norm": "no_colon"}})
    acc = get_accelerator("kunlun", options={"kernel_overrides": {"rms_norm": "torch_xmlir.ops:nope"}})
    with pytest.raises(PluginError, match="kernel override rms_norm -> torch_xmlir.ops:nope cannot be loaded"):
        acc.kernel_overrides()


def test_bkcl_is_reported_as_nccl_to_megatron_core_on_hardware():
    pytest.importorskip("megatron.core")
    import megatron.core.utils as mutils

    assert megatron_adaptations(device_type="cpu", dist_backend="kccl") == []
    assert megatron_adaptations(device_type="cuda", dist_backend="nccl") == []
    adaptations = megatron_adaptations(device_type="cuda", dist_backend="kccl")
    original = mutils.torch
    with AdaptationSet(adaptations) as s:
        assert s.names == ["kunlun-bkcl-is-nccl"]
        assert isinstance(mutils.torch, TorchView) and mutils.torch.tensor is original.tensor
    assert mutils.torch is original

    class Dist:
        def get_backend(self, group=None):
            return "kccl" if group is None else "gloo"

    view = _DistributedView(Dist())
    assert view.get_backend() == "nccl" and view.get_backend("g") == "gloo"
