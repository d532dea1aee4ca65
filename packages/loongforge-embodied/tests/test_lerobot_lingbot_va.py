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
    from loongforge_embodied.policies.lerobot_lingbot_va.modeling_lerobot_lingbot_va import (
        LeRobotLingBotVAModel,
    )
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


def test_a_batch_with_per_sample_draws_equals_each_sample_alone(tiny):
    """Each sample's timesteps, noise, noised-condition coin and attention chunk / window are its own: a batch whose
    samples drew differently gives each sample's loss alone (a window of one block masks here; LeRobot draws once
    per batch, so only our per-sample path reaches this)."""
    arch, model, _, _, inp = tiny
    d0, d1 = _draws(0, b=2, arch=arch), _draws(1, b=2, arch=arch)
    mixed = {k: torch.stack([d0[k][0], d1[k][1]]) for k in d0}
    mixed["mask_chunk"], mixed["mask_window"] = torch.tensor([1, 2]), torch.tensor([1, 64])
    assert bool(mixed["noisy_cond"][0]) != bool(mixed["noisy_cond"][1])
    with torch.no_grad():
        both = model({**inp, **mixed})
        alone = [model({**{k: v[i: i + 1] for k, v in inp.items()}, **{k: v[i: i + 1] for k, v in mixed.items()}})
                 for i in range(2)]
        wide = model({**inp, **mixed, "mask_window": torch.tensor([64, 64])})
    torch.testing.assert_close(both, torch.cat(alone), rtol=1e-5, atol=0)
    assert not torch.allclose(wide[0], both[0])  # NOTE: the one-block window really masked sample 0's attention


def _lerobot_chunk(policy, frame: dict, seed: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The first chunk of LeRobot's ``select_action`` (its first action and the queued rest) for one observation,
    and the starting latents / actions it drew after ``torch.manual_seed(seed)``."""
    a = policy.config
    h, w = a.height // 16, a.width // 16 * len(a.obs_cam_keys)
    torch.manual_seed(seed)
    start = (torch.randn(1, 48, a.frame_chunk_size, h, w), torch.randn(1, a.action_dim, a.frame_chunk_size,
                                                                        a.action_per_frame, 1))
    policy.reset()
    torch.manual_seed(seed)
    first = policy.select_action(frame)
    return torch.stack([first, *policy._action_queue], dim=1), start


def test_sampling_matches_lerobot_select_action(tiny):
    """Our batched ``sample_actions`` (two requests, two prompts) from LeRobot's starting draws equals LeRobot's first
    chunk of each request alone (its KV cache, classifier-free guidance against the empty prompt)."""
    from loongforge_embodied.policies.lerobot_lingbot_va.processor_lerobot_lingbot_va import prepare_batch

    arch, model, raw, stats, _ = tiny
    policy = _lerobot(arch, model, attn_mode="torch")
    theirs, starts = zip(*[_lerobot_chunk(policy, {CAM: raw["images"][i:i + 1, 0, 0], "task": [raw["task"][i]]},
                                          seed=5 + i) for i in range(2)], strict=True)
    inp = prepare_batch({"images": raw["images"][:, :, 0], "state": raw["state"], "task": raw["task"]}, arch=arch,
                        stats=stats)
    start = tuple(torch.cat(s) for s in zip(*starts, strict=True))
    ours = model.eval().sample_actions(inp, start=start)
    model.train()
    assert ours.shape == (2, arch.served_steps, arch.action_dim) and arch.guidance > 1
    torch.testing.assert_close(ours, torch.cat(theirs), rtol=0, atol=1e-5)


def test_recompute_keeps_the_loss_and_gradients(tiny):
    import copy

    arch, model, _, _, inp = tiny
    inp = {**inp, **_draws(1, b=2, arch=arch)}
    other = copy.deepcopy(model)
    other.enable_activation_checkpointing()
    out = []
    for m in (model, other):
        m.zero_grad(set_to_none=True)
        loss = m(inp)
        loss.sum().backward()
        out.append((loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                                    for n, p in m.named_parameters() if p.grad is not None}))
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(out[0][0], out[1][0], rtol=TOL, atol=0)
    assert out[0][1].keys() == out[1][1].keys()
    for name, g in out[0][1].items():
        torch.testing.assert_close(g, out[1][1][name], rtol=1e-4, atol=1e-6, msg=name)
    assert len(other.wrap_units()) == arch.num_layers



def test_bf16_frozen_parts_keep_the_loss_close(tiny):
    """``frozen_dtype: bfloat16`` (the published preset's) holds the VAE and text encoder in bf16; the transformer
    stays fp32 and the loss stays within bf16's precision of the fp32 one."""
    from loongforge_embodied.policies.lerobot_lingbot_va.modeling_lerobot_lingbot_va import (
        LeRobotLingBotVAModel,
    )

    arch, model, _, _, inp = tiny
    inp = {**inp, **_draws(1, b=2, arch=arch)}
    half = LeRobotLingBotVAModel(arch.with_overrides(frozen_dtype="bfloat16"))
    half.load_state_dict(model.state_dict())
    assert all(next(m.parameters()).dtype == torch.bfloat16 for m in half._frozen.values())
    assert all(p.dtype == torch.float32 for p in half.parameters())
    with torch.no_grad():
        torch.testing.assert_close(half(inp), model(inp), rtol=0.05, atol=1e-3)

@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("lerobot") / "tiny")


def test_recipe_trains_on_a_lerobot_dataset_exports_for_lerobot_and_serves(wan, dataset, tmp_path, monkeypatch):
    from lerobot.policies.lingbot_va import LingBotVAPolicy
    from loongforge.cli import main
    from loongforge.metrics import read_metrics
    from loongforge_embodied.eval.server import PolicyServer
    from loongforge_embodied.eval.trained_policy import TrainedPolicy
    from loongforge_embodied.policies.lerobot_lingbot_va.export import load_model
    from loongforge_embodied.policies.lerobot_lingbot_va.processor_lerobot_lingbot_va import prepare_batch
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["train", str(RECIPE), "--output", str(out), f"model.arch.wan={wan}", "data.format=lerobot",
                     f"data.root={dataset}", "model.freeze=[video]", "logging.tensorboard=false"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 4] and all(np.isfinite(losses))
    hf = out / "hf"
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["type"] == "lingbot_va" and cfg["wan_pretrained_path"] == str(wan) and cfg["obs_cam_keys"] == [CAM]
    ours = load_model(hf).eval()
    policy = LingBotVAPolicy.from_pretrained(hf, strict=True)
    theirs = policy.state_dict()
    assert set(theirs) == {k for k in ours.state_dict() if not k.startswith("stats.")}
    for key, value in theirs.items():
        assert torch.equal(value, ours.state_dict()[key]), key
    # select_action of LeRobot's own policy = our model's chunk (normalised: LeRobot's post-processor is q01 / q99)
    g = torch.Generator().manual_seed(3)
    frame = {CAM: torch.rand(1, 3, 24, 28, generator=g), "task": ["push the block"]}
    chunk, start = _lerobot_chunk(policy, frame, seed=11)
    stats = {k: torch.tensor(v) for k, v in json.loads((hf / "loongforge.json").read_text())["stats"].items()}
    raw = {"images": frame[CAM][:, None], "state": torch.zeros(1, 2), "task": frame["task"]}
    mine = ours.sample_actions(prepare_batch(raw, arch=ours.arch, stats=stats), start=start)
    assert chunk.shape == mine.shape == (1, ours.arch.served_steps, 2)
    torch.testing.assert_close(mine, chunk, rtol=0, atol=1e-5)
    # served: the openpi client gets the chunk of our model for the same request (noise seeded by the request)
    served = TrainedPolicy.load(out)
    request = {CAM: (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8),
               "observation.state": np.array([0.5, -0.5], np.float32), "prompt": "push the block"}
    with PolicyServer(served, port=0, batch_wait_s=0.0) as server:
        client = WebsocketClientPolicy(host=server.address)
        meta = client.get_server_metadata()
        assert meta["features"][CAM]["shape"] == [32, 32, 3]
        assert meta["chunk_size"] == meta["n_action_steps"] == ours.arch.served_steps
        actions = client.infer(request)["actions"]
    assert actions.shape == (ours.arch.served_steps, 2) and np.isfinite(actions).all()
    np.testing.assert_allclose(actions, served.infer_batch([request])[0]["actions"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_ddp_zero1_and_fsdp2_match_single_process(wan, tmp_path, env, ranks):
    """2 gloo ranks, ddp / zero1 / fsdp2 (units: the transformer blocks), in one launch, reproduce the one-process
    losses over 3 steps."""
    from .strategy_losses import one_and_two_ranks

    single, two = one_and_two_ranks(ranks, tmp_path, env=env, extra=(f"model.arch.wan={wan}",),
                                    recipe_name=RECIPE.name, strategies=["ddp", "zero1", "fsdp2"])
    for strategy, losses in two["losses"].items():
        assert losses == pytest.approx(single, rel=TOL), (strategy, losses, single)
    assert two["layouts"]["fsdp2"]["placements"] == ["S(0)"] and two["layouts"]["ddp"] == {}


def test_recipes_resolve_and_bad_input_is_one_line(wan, tmp_path, capsys):
    from loongforge.cli import main

    assert main(["validate", str(RECIPE), "model.arch.wan=/nowhere/wan"]) == 0
    assert main(["validate", str(RECIPE.with_name("lerobot_lingbot_va_pusht.yaml"))]) == 0
    capsys.readouterr()
    assert main(["train", str(RECIPE), "--output", str(tmp_path / "run"), "model.arch.wan=/nowhere/wan"]) == 2
    err = capsys.readouterr().err
    assert "key 'model.arch.wan': '/nowhere/wan': no local folder" in err and err.count("\n") == 1, err
    assert main(["validate", str(RECIPE), "model.arch.chunk_size=6"]) == 2
    assert "chunk_size 6 is not frame_chunk_size x action_per_frame (2 x 2)" in capsys.readouterr().err
    assert main(["train", str(RECIPE), "--output", str(tmp_path / "run3"), f"model.arch.wan={wan}",
                 "model.freeze=[vision]"]) == 2
    assert "lerobot_lingbot_va has no component vision; allowed: video, action, expert" in capsys.readouterr().err


def test_published_size_is_wan2_2_ti2v_5b():
    """The ``lingbot_va`` preset's transformer on the meta device: Wan2.2-TI2V-5B's (30 layers, 3072 wide: 5B)."""
    from lerobot.policies.lingbot_va.utils import WanTransformer3DModel
    from loongforge_embodied.policies.lerobot_lingbot_va.build import transformer_kwargs
    from loongforge_embodied.policies.lerobot_lingbot_va.configuration_lerobot_lingbot_va import PRESETS

    with torch.device("meta"):
        size = sum(p.numel() for p in WanTransformer3DModel(**transformer_kwargs(PRESETS["lingbot_va"])).parameters())
    assert round(size / 1e9) == 5, size
