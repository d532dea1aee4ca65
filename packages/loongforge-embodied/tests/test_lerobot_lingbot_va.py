"""LeRobot's own LingBot-VA (``LingBotVAPolicy``: an autoregressive video-action world model on Wan2.2's dual-stream
transformer) through our trainer, on a tiny Wan2.2 VAE saved by diffusers, a tiny UMT5 text encoder and T5 tokenizer
saved by transformers, on the CPU (fp32).

Parity: our per-sample loss (our processor + model), averaged, equals ``LingBotVAPolicy.forward`` on the same batch
from the same weights and the same draws. LeRobot trains only through flex attention, in bf16: its reference here
runs with its two bf16 casts (the transformer's inputs in ``forward_train`` and flex attention's q / k / v) made
fp32, and flex attention and its block masks run eagerly (no ``torch.compile``); the rest is LeRobot's code.
The recipe trains through the CLI on a LeRobotDataset v3 (clips of later frames); its export loads with LeRobot's
plain ``LingBotVAPolicy.from_pretrained`` and ``select_action`` gives our model's actions; ``loongforge serve``'s
policy answers the openpi client; ddp / zero1 / fsdp2 on 2 gloo ranks give the one-process losses.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from .test_lerobot_fastwam import make_dataset, make_tiny_wan

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "embodied" / "lerobot_lingbot_va_tiny.yaml"
TOL = 1e-5
CAM = "observation.images.cam0"


def make_tokenizer(out: Path) -> Path:
    """A character-level T5 (unigram) tokenizer saved by transformers (UMT5's pad / eos / unk first)."""
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0), *[(chr(c), -3.0) for c in range(33, 127)]]
    T5TokenizerFast(vocab=vocab, extra_ids=0).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Path:
    """A tiny LingBot-VA directory: vae/, text_encoder/ and tokenizer/."""
    out = make_tiny_wan(tmp_path_factory.mktemp("lingbot") / "wan")
    make_tokenizer(out / "tokenizer")
    return out


@pytest.fixture(scope="module")
def tiny(wan):
    from loongforge_embodied.policies.lerobot_lingbot_va.configuration_lerobot_lingbot_va import PRESETS
    from loongforge_embodied.policies.lerobot_lingbot_va.modeling_lerobot_lingbot_va import LeRobotLingBotVAModel
    from loongforge_embodied.policies.lerobot_lingbot_va.processor_lerobot_lingbot_va import prepare_batch

    arch = PRESETS["tiny"].with_overrides(wan=str(wan))
    torch.manual_seed(0)
    model = LeRobotLingBotVAModel(arch)
    g = torch.Generator().manual_seed(1)
    b, frames = 2, len(arch.frame_offsets)
    raw = {"images": torch.rand(b, 1, frames, 3, 24, 28, generator=g), "state": torch.randn(b, 2, generator=g),
           "actions": torch.randn(b, arch.chunk_size, 2, generator=g), "task": ["push it", "a longer task"]}
    stats = {"state_mean": torch.tensor([0.1, -0.2]), "state_std": torch.tensor([1.5, 0.7]),
             "action_mean": torch.tensor([0.3, 0.0]), "action_std": torch.tensor([2.0, 0.5])}
    model.set_stats(stats)
    return arch, model, raw, stats, prepare_batch(raw, arch=arch, stats=stats)


class _Fp32Torch(types.ModuleType):
    """``torch`` as LeRobot's LingBot-VA module sees it for the fp32 reference: ``bfloat16`` is float32."""

    def __getattr__(self, name):
        return torch.float32 if name == "bfloat16" else getattr(torch, name)


def _flex_fp32(self, query, key, value, dtype=None):
    """``FlexAttnFunc.forward`` without its bf16 cast: the same layout and block masks, flex attention in fp32."""
    from einops import rearrange
    from lerobot.policies.lingbot_va.utils import FlexAttnFunc

    q, k, v = (rearrange(x[0], "s n d -> 1 n s d") for x in (query, key, value))
    mask = FlexAttnFunc.cross_attention_mask if self.is_cross else FlexAttnFunc.attention_mask
    return rearrange(FlexAttnFunc.flex_attn(q, k, v, block_mask=mask), "b n s d -> b s n d")


@pytest.fixture
def lerobot_fp32():
    """LeRobot's LingBot-VA training in fp32 with eager flex attention (see the module's docstring)."""
    import torch._inductor.config  # noqa: F401  (LeRobot's init_mask sets an inductor option)
    from lerobot.policies.lingbot_va import utils
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def eager_block_mask(*args, _compile=False, **kwargs):
        return create_block_mask(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(utils, "torch", _Fp32Torch("torch"))
        mp.setattr(utils.FlexAttnFunc, "forward", _flex_fp32)
        mp.setattr(utils.FlexAttnFunc, "flex_attn", flex_attention)
        mp.setattr(utils.FlexAttnFunc, "compiled_create_block_mask", eager_block_mask)
        yield


def _lerobot(arch, model, *, attn_mode="flex"):
    """LeRobot's own ``LingBotVAPolicy`` with our weights, its frozen parts loaded."""
    from lerobot.policies.lingbot_va import LingBotVAPolicy
    from loongforge_embodied.policies.lerobot_lingbot_va.build import lingbot_config

    policy = LingBotVAPolicy(lingbot_config(arch, cameras=[CAM], attn_mode=attn_mode))
    policy.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("stats.")}, strict=True)
    policy._ensure_frozen_modules()
    return policy


def _draws(seed: int, *, b: int, arch) -> dict[str, torch.Tensor]:
    """``LingBotVAPolicy.training_loss_from_streams``'s own draws after ``torch.manual_seed(seed)``, per sample."""
    f = arch.frame_chunk_size

    def ids(low=0.0):
        return ((torch.rand(f) * (1.0 - low) + low) * 1000).clamp(0, 999).long().expand(b, -1)

    torch.manual_seed(seed)
    out = {"latent_ids": ids(), "latent_noise": torch.randn(b, *arch.latent_shape)}
    coin = bool(torch.rand(1).item() < 0.5)
    out["noisy_cond"] = torch.full((b,), coin)
    out["cond_ids"] = ids(0.5) if coin else torch.zeros(b, f, dtype=torch.long)
    out["cond_noise"] = torch.randn(b, *arch.latent_shape) if coin else torch.zeros(b, *arch.latent_shape)
    out["action_ids"], out["action_noise"] = ids(), torch.randn(b, *arch.action_shape)
    torch.rand(1)  # the action stream's noising choice (its probability is 0)
    out["mask_chunk"] = torch.randint(1, 5, (1,)).expand(b)
    out["mask_window"] = torch.randint(4, 65, (1,)).expand(b)
    return out


@pytest.mark.parametrize("seed", [0, 1])  # NOTE: seed 1 noises the clean video copy, 0 does not
def test_loss_matches_lerobot_policy_forward(tiny, lerobot_fp32, seed):
    arch, model, raw, _, inp = tiny
    policy = _lerobot(arch, model)
    batch = {CAM: raw["images"][:, 0], "task": raw["task"], "action": inp["actions"]}
    draws = _draws(seed, b=2, arch=arch)
    torch.manual_seed(seed)
    with torch.no_grad():  # NOTE: flex attention has no backward on the CPU
        ref, parts = policy.forward(batch)
    after = torch.rand(1)
    _draws(seed, b=2, arch=arch)
    assert torch.equal(after, torch.rand(1))  # NOTE: LeRobot drew exactly what _draws replays
    ours = model({**inp, **draws})
    torch.testing.assert_close(ours.mean(), ref, rtol=TOL, atol=0)
    assert parts["latent_loss"] > 0 and parts["action_loss"] > 0
    ours.mean().backward()  # NOTE: every trainable weight reaches the loss (what FSDP2 / DDP need)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    assert inp["video"].shape == (2, 1, 3, 8, 32, 32) and inp["input_ids"].shape == (2, 512)
