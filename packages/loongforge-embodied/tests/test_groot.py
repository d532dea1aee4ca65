"""The GR00T-style policy on CPU: shapes, learning a fixed batch, per-embodiment gradients, frozen backbone,
padding masks, and its recipe through the CLI (validate → train → export → LeRobot ``select_action``).
Multi-process equivalence (ddp / fsdp2 vs one process) is parametrized in test_strategies.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loongforge_embodied.data.dataset import FlowSamples, SyntheticSource, collate
from loongforge_embodied.policies.groot.configuration_groot import PRESETS
from loongforge_embodied.policies.groot.modeling_groot import GrootModel
from loongforge_embodied.policies.groot.processor_groot import prepare_batch

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "embodied" / "tiny_groot_synthetic.yaml"
ARCH = PRESETS["tiny"]


def _batch(n: int = 4, *, embodiments: list[int] | None = None, pad_last: int = 0) -> dict[str, torch.Tensor]:
    """Collated like the trainer's loader (per-sample seeded noise and flow time)."""
    src = SyntheticSource(arch=ARCH, num_samples=64, task="Push the T-shaped block onto the target.")
    ds = FlowSamples(src, arch=ARCH, seed=0)
    items = [ds[(i, i)] for i in range(n)]
    for i, item in enumerate(items):
        if embodiments is not None:
            item["embodiment_id"] = torch.tensor(embodiments[i])
        if pad_last:
            item["action_pad"][-pad_last:] = True
    return collate(items, prepare=prepare_batch, arch=ARCH, stats=src.stats())


def _model(seed: int = 0) -> GrootModel:
    torch.manual_seed(seed)
    return GrootModel(ARCH)


def _category_linears(model: GrootModel):
    head = model.action_head
    return [head.state_encoder.layer1, head.state_encoder.layer2, head.action_encoder.W1, head.action_encoder.W2,
            head.action_encoder.W3, head.action_decoder.layer1, head.action_decoder.layer2]


def test_forward_backward_and_sampling_shapes():
    model, batch = _model(), _batch(3)
    assert batch["actions"].shape == (3, ARCH.chunk_size, ARCH.max_action_dim)
    assert batch["state"].shape == (3, ARCH.max_state_dim)
    loss = model(batch)
    assert loss.shape == (3,) and torch.isfinite(loss).all()
    loss.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    actions = model.sample_actions(batch)
    assert actions.shape == (3, ARCH.chunk_size, ARCH.action_dim) and torch.isfinite(actions).all()
    # blocks in execution order: vision, language, VL self-attention, DiT
    assert len(model.wrap_units()) == ARCH.vision_layers + ARCH.lm_layers + ARCH.vl_layers + ARCH.dit_layers


def test_n15_preset_has_the_size_of_gr00t_n15():
    with torch.device("meta"):
        model = GrootModel(PRESETS["n1.5"])
    size = {k: sum(p.numel() for m in mods for p in m.parameters()) for k, mods in model.components().items()}
    assert 2.2e9 < sum(size.values()) < 2.6e9, size
    assert 1.2e9 < size["vision"] + size["language"] < 1.45e9 and 0.95e9 < size["expert"] < 1.2e9, size


def test_loss_decreases_on_a_fixed_batch():
    model, batch = _model(), _batch(8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(30):
        loss = model(batch).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_only_present_embodiments_get_gradients():
    model = _model()
    model(_batch(4, embodiments=[1, 3, 3, 1])).mean().backward()
    for layer in _category_linears(model):
        for grad in (layer.W.grad, layer.b.grad):
            rows = grad.flatten(1).abs().sum(1)
            assert (rows[[1, 3]] > 0).all() and (rows[[0, 2]] == 0).all(), rows


def test_frozen_backbone_gets_no_gradients():
    model = _model()
    for name in ("vision", "language"):
        for m in model.components()[name]:
            m.requires_grad_(False)
    model(_batch(2)).mean().backward()
    assert all(p.grad is None for p in model.backbone.parameters())
    head = dict(model.action_head.named_parameters())
    assert all(p.grad is not None for p in head.values()), [n for n, p in head.items() if p.grad is None]


def test_padded_steps_and_dims_do_not_count():
    model, batch = _model(), _batch(2, pad_last=3)
    masked = ~batch["action_mask"]
    assert masked[:, -3:].all() and masked[..., ARCH.action_dim:].all()
    # NOTE: at τ = 1 the input x_τ is the noise alone, so moving the actions moves only the velocity targets.
    at_noise = {**batch, "time": torch.ones_like(batch["time"])}
    moved_padding = {**at_noise, "actions": batch["actions"] + 5.0 * masked.float()}
    moved_valid = {**at_noise, "actions": batch["actions"] + 5.0 * (~masked).float()}
    assert torch.equal(model(moved_padding), model(at_noise))
    assert not torch.allclose(model(moved_valid), model(at_noise))


def test_recipe_validates_trains_and_exports_through_the_cli(tmp_path, monkeypatch):
    from loongforge.cli import main
    from loongforge.metrics import read_metrics

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["validate", str(RECIPE)]) == 0
    run = tmp_path / "run"
    code = main(["train", str(RECIPE), "--output", str(run), "train.steps=3", "checkpoint.save_format=[dist,hf]",
                 "logging.interval=1", "logging.tensorboard=false"])
    assert code == 0
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] > 0 for r in records)

    from lerobot.policies.factory import get_policy_class
    from lerobot.utils.import_utils import register_third_party_plugins

    register_third_party_plugins()  # LeRobot's own discovery registers the type (lerobot_policy_loongforge)

    policy = get_policy_class("loongforge_groot").from_pretrained(run / "hf")
    obs = {k: torch.rand(2, 3, 64, 64) for k in policy.config.camera_keys}
    obs |= {"observation.state": torch.randn(2, ARCH.state_dim), "task": ["Push the T-shaped block."] * 2}
    action = policy.select_action(obs)
    assert action.shape == (2, ARCH.action_dim) and torch.isfinite(action).all()
    assert len(policy._queue) == policy.config.n_action_steps - 1


@pytest.mark.parametrize(("override", "message"), [
    ("model.preset=pi05", "unknown preset 'pi05' for policy groot"),
    ("model.arch={max_action_dim: 1}", "action_dim 2 > max_action_dim 1"),
])
def test_bad_groot_recipes_are_one_line_errors(override, message):
    from loongforge.errors import LoongForgeError
    from loongforge.recipe import load_recipe

    with pytest.raises(LoongForgeError, match=message):
        load_recipe(RECIPE, [override])
