"""LeRobot's own X-VLA (``XVLAModel``) through our trainer, on a tiny Florence-2 config and a tiny tokenizer saved by
transformers, on the CPU (fp32).

Parity: our per-sample loss (our processor + model), averaged, equals ``XVLAPolicy.forward`` on the batch LeRobot's
own X-VLA pre-processor makes, from the same weights and the same noise / time draws. The recipe trains through the
CLI on a LeRobotDataset v3; its export loads with LeRobot's plain ``XVLAPolicy.from_pretrained`` and
``select_action`` gives our model's actions; ``loongforge serve``'s policy answers the openpi client; ddp / zero1 /
fsdp2 on 2 gloo ranks give the one-process losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "embodied" / "lerobot_xvla_tiny.yaml"
TOL = 1e-5
CAM = "observation.images.cam0"


def make_tiny_florence(out: Path) -> Path:
    """A tiny Florence-2 config saved by transformers: a 2-stage DaViT (32² frames → 16 tokens of 32) and a 2-layer
    BART encoder of width 32; no dropout."""
    from transformers import Florence2Config

    Florence2Config(
        vision_config={"depths": [1, 1], "embed_dim": [16, 32], "num_heads": [1, 2], "num_groups": [1, 2],
                       "patch_size": [7, 3], "patch_stride": [4, 2], "patch_padding": [3, 1],
                       "patch_prenorm": [False, True], "window_size": 2, "drop_path_rate": 0.0, "projection_dim": 32,
                       "max_position_embeddings": 8, "max_temporal_embeddings": 4},
        text_config={"model_type": "bart", "vocab_size": 104, "d_model": 32, "encoder_layers": 2, "decoder_layers": 1,
                     "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
                     "decoder_ffn_dim": 64, "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
                     "max_position_embeddings": 64},
        image_token_id=103).save_pretrained(out)
    return out


def make_tokenizer(out: Path) -> Path:
    """A character-level tokenizer saved by transformers (BART's special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "<pad>", "</s>", "<unk>", *map(chr, range(32, 127))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("xvla")
    return make_tiny_florence(root / "florence"), make_tokenizer(root / "tokenizer")


def _extra(dirs) -> tuple[str, ...]:
    return (f"model.arch.florence={dirs[0]}", f"model.arch.tokenizer={dirs[1]}")


@pytest.fixture(scope="module")
def tiny(dirs):
    from loongforge_embodied.policies.lerobot_xvla.configuration_lerobot_xvla import PRESETS
    from loongforge_embodied.policies.lerobot_xvla.modeling_lerobot_xvla import LeRobotXVLAModel
    from loongforge_embodied.policies.lerobot_xvla.processor_lerobot_xvla import prepare_batch

    # NOTE: mean / std normalisation (LeRobot's own step) and a second, empty view exercise the processor
    arch = PRESETS["tiny"].with_overrides(florence=str(dirs[0]), tokenizer=str(dirs[1]), normalization="mean_std",
                                          num_image_views=2)
    torch.manual_seed(0)
    model = LeRobotXVLAModel(arch)
    g = torch.Generator().manual_seed(1)
    b = 3
    raw = {"images": torch.rand(b, 1, 3, 24, 28, generator=g), "state": torch.randn(b, 2, generator=g),
           "actions": torch.randn(b, arch.chunk_size, 2, generator=g),
           "task": ["push it", "a much longer task than the others", "x"]}
    stats = {"state_mean": torch.tensor([0.1, -0.2]), "state_std": torch.tensor([1.5, 0.7]),
             "action_mean": torch.tensor([0.3, 0.0]), "action_std": torch.tensor([2.0, 0.5])}
    model.set_stats(stats)
    return arch, model, raw, stats, prepare_batch(raw, arch=arch, stats=stats)


def _lerobot(arch, model, stats):
    """LeRobot's own ``XVLAPolicy`` with our weights, and its own pre / post-processors for ``stats``."""
    from lerobot.policies.xvla.modeling_xvla import XVLAPolicy
    from lerobot.policies.xvla.processor_xvla import make_xvla_pre_post_processors
    from loongforge_embodied.policies.lerobot_xvla.build import set_dropout, xvla_config

    policy = XVLAPolicy(xvla_config(arch, cameras=[CAM]))
    set_dropout(policy.model, arch.dropout_percent / 100)
    policy.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("stats.")}, strict=True)
    ds_stats = {"observation.state": {"mean": stats["state_mean"], "std": stats["state_std"]},
                "action": {"mean": stats["action_mean"], "std": stats["action_std"]}}
    return (policy, *make_xvla_pre_post_processors(policy.config, dataset_stats=ds_stats))


def _draws(seed: int, *, b: int, chunk: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``XVLAModel.forward``'s own draws after ``torch.manual_seed(seed)``: stratified time, then the noise."""
    torch.manual_seed(seed)
    t = (torch.rand(1) + torch.arange(b) / b) % (1 - 1e-5)
    return t, torch.randn(b, chunk, width)


def test_loss_matches_lerobot_policy_forward(tiny):
    arch, model, raw, stats, inp = tiny
    policy, pre, _ = _lerobot(arch, model, stats)
    batch = pre({CAM: raw["images"][:, 0], "observation.state": raw["state"], "task": raw["task"],
                 "action": raw["actions"]})
    t, noise = _draws(7, b=3, chunk=arch.chunk_size, width=arch.action_width)
    torch.manual_seed(7)
    ref, _ = policy.forward(batch)
    ours = model({**inp, "time": t, "noise": noise})
    torch.testing.assert_close(ours.mean(), ref, rtol=TOL, atol=0)
    ours.mean().backward()  # NOTE: every trainable weight reaches the loss (what FSDP2 / DDP need)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(inp["input_ids"], batch["observation.language.tokens"], rtol=0, atol=0)
    assert inp["images"].shape == (3, 2, 3, 32, 32) and inp["image_mask"].tolist() == [[True, False]] * 3


def test_sampling_matches_lerobot_predict_action_chunk(tiny):
    """Our ``sample_actions`` from the noise ``generate_actions`` draws equals ``predict_action_chunk`` (eval)."""
    arch, model, raw, stats, inp = tiny
    policy, pre, post = _lerobot(arch, model, stats)
    frames = pre({CAM: raw["images"][:, 0], "observation.state": raw["state"], "task": raw["task"]})
    torch.manual_seed(5)
    noise = torch.randn(3, arch.chunk_size, arch.action_width)
    torch.manual_seed(5)
    theirs = post(policy.predict_action_chunk(frames))
    ours = model.eval().unnormalize_actions(model.sample_actions(inp, noise=noise))
    model.train()
    assert ours.shape == theirs.shape == (3, arch.chunk_size, arch.action_dim)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_recompute_keeps_the_loss_and_gradients(tiny):
    from loongforge_embodied.policies.lerobot_xvla.modeling_lerobot_xvla import LeRobotXVLAModel

    arch, model, _, _, inp = tiny
    inp = {**inp, "time": torch.tensor([0.2, 0.5, 0.9]), "noise": torch.randn(3, arch.chunk_size, arch.action_width)}
    other = LeRobotXVLAModel(arch)
    other.load_state_dict(model.state_dict())
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
    assert len(other.wrap_units()) == 2 + 2 + arch.depth


def make_dataset(root: Path, *, episodes: int = 2, frames: int = 6) -> Path:
    """A tiny LeRobotDataset v3 written by LeRobot itself (random 24x28 frames: resized with padding to 32²). The
    camera is keyed ``observation.images.*``: LeRobot's X-VLA pre-processor ImageNet-normalises those keys only."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {
        CAM: {"dtype": "image", "shape": (24, 28, 3), "names": ["height", "width", "channel"]},
        "observation.state": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
        "action": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
    }
    ds = LeRobotDataset.create("local/tiny", fps=10, root=root, features=features, use_videos=False)
    rng = np.random.default_rng(0)
    for _ in range(episodes):
        for _ in range(frames):
            ds.add_frame({CAM: rng.integers(0, 255, (24, 28, 3), dtype=np.uint8),
                          "observation.state": rng.standard_normal(2).astype(np.float32),
                          "action": rng.standard_normal(2).astype(np.float32), "task": "push the block"})
        ds.save_episode()
    ds.finalize()
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("lerobot") / "tiny")


def test_recipe_trains_on_a_lerobot_dataset_exports_for_lerobot_and_serves(dirs, dataset, tmp_path, monkeypatch):
    from lerobot.policies.xvla.modeling_xvla import XVLAPolicy
    from lerobot.policies.xvla.processor_xvla import make_xvla_pre_post_processors
    from loongforge.cli import main
    from loongforge.metrics import read_metrics
    from loongforge_embodied.eval.server import PolicyServer
    from loongforge_embodied.eval.trained_policy import TrainedPolicy
    from loongforge_embodied.policies.lerobot_xvla.export import load_model
    from loongforge_embodied.policies.lerobot_xvla.processor_lerobot_xvla import prepare_batch
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["train", str(RECIPE), "--output", str(out), *_extra(dirs), "data.format=lerobot",
                     f"data.root={dataset}", "model.freeze=[vision]", "model.arch.normalization=mean_std",
                     "logging.tensorboard=false"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 4] and all(np.isfinite(losses))
    hf = out / "hf"
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["type"] == "xvla" and cfg["tokenizer_name"] == str(dirs[1]) and cfg["florence_config"]["vision_config"]
    ours = load_model(hf).eval()
    policy = XVLAPolicy.from_pretrained(hf, strict=True)
    theirs = policy.state_dict()
    assert set(theirs) == {k for k in ours.state_dict() if not k.startswith("stats.")}
    for key, value in theirs.items():
        assert torch.equal(value, ours.state_dict()[key]), key
    # select_action of LeRobot's own policy (its pre/post-processors on the exported statistics) = our model's
    stats = {k: torch.tensor(v) for k, v in json.loads((hf / "loongforge.json").read_text())["stats"].items()}
    pre, post = make_xvla_pre_post_processors(policy.config, dataset_stats={
        "observation.state": {"mean": stats["state_mean"], "std": stats["state_std"]},
        "action": {"mean": stats["action_mean"], "std": stats["action_std"]}})
    g = torch.Generator().manual_seed(3)
    frame = {CAM: torch.rand(3, 24, 28, generator=g), "observation.state": torch.randn(2, generator=g),
             "task": "push the block"}
    torch.manual_seed(11)
    noise = torch.randn(1, ours.arch.chunk_size, ours.arch.action_width)
    torch.manual_seed(11)
    first = post(policy.select_action(pre(dict(frame))))
    raw = {"images": frame[CAM][None, None], "state": frame["observation.state"][None],
           "task": [frame["task"]]}
    chunk = ours.unnormalize_actions(ours.sample_actions(prepare_batch(raw, arch=ours.arch, stats=stats), noise=noise))
    assert first.shape == (1, 2)
    torch.testing.assert_close(first, chunk[:, 0], rtol=0, atol=1e-5)
    # served: the openpi client gets the chunk of our model for the same request (noise seeded by the request)
    served = TrainedPolicy.load(out)
    request = {CAM: (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8),
               "observation.state": np.array([0.5, -0.5], np.float32), "prompt": "push the block"}
    with PolicyServer(served, port=0, batch_wait_s=0.0) as server:
        client = WebsocketClientPolicy(host=server.address)
        assert client.get_server_metadata()["features"][CAM]["shape"] == [32, 32, 3]
        actions = client.infer(request)["actions"]
    assert actions.shape == (ours.arch.chunk_size, 2) and np.isfinite(actions).all()
    np.testing.assert_allclose(actions, served.infer_batch([request])[0]["actions"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_ddp_zero1_and_fsdp2_match_single_process(dirs, tmp_path, env, ranks):
    """2 gloo ranks, ddp / zero1 / fsdp2 (units: DaViT stages, BART encoder layers, transformer blocks), in one
    launch, reproduce the one-process losses over 3 steps."""
    from .strategy_losses import one_and_two_ranks

    single, two = one_and_two_ranks(ranks, tmp_path, env=env, extra=_extra(dirs), recipe_name=RECIPE.name,
                                    strategies=["ddp", "zero1", "fsdp2"])
    for strategy, losses in two["losses"].items():
        assert losses == pytest.approx(single, rel=TOL), (strategy, losses, single)
    assert two["layouts"]["fsdp2"]["placements"] == ["S(0)"] and two["layouts"]["ddp"] == {}


def test_recipes_resolve_and_missing_directories_are_one_line(dirs, tmp_path, capsys):
    from loongforge.cli import main

    assert main(["validate", str(RECIPE), "model.arch.florence=/nowhere/florence"]) == 0
    assert main(["validate", str(RECIPE.with_name("lerobot_xvla_pusht.yaml"))]) == 0
    capsys.readouterr()
    assert main(["train", str(RECIPE), "--output", str(tmp_path / "run"), "model.arch.florence=/nowhere/fl"]) == 2
    err = capsys.readouterr().err
    assert "key 'model.arch.florence': '/nowhere/fl': no local folder" in err and err.count("\n") == 1, err
    assert main(["train", str(RECIPE), "--output", str(tmp_path / "run2"), f"model.arch.florence={dirs[0]}",
                 "model.arch.tokenizer=/nowhere/tok"]) == 2
    assert "key 'model.arch.tokenizer': '/nowhere/tok': no local folder" in capsys.readouterr().err
    assert main(["validate", str(RECIPE), "model.arch.action_mode=polar"]) == 2
    assert "action_mode 'polar' (allowed: auto, ee6d, joint)" in capsys.readouterr().err


def test_published_size_is_xvla_0_9b(tmp_path):
    """The ``xvla`` preset on Florence-2-large's sizes (written here by transformers), on the meta device: X-VLA-0.9B
    (Florence-2-large's DaViT and BART-large encoder + the 24-layer, 1024-wide transformer)."""
    from loongforge_embodied.policies.lerobot_xvla.configuration_lerobot_xvla import PRESETS
    from loongforge_embodied.policies.lerobot_xvla.modeling_lerobot_xvla import LeRobotXVLAModel
    from transformers import Florence2Config

    Florence2Config(
        vision_config={"depths": [1, 1, 9, 1], "embed_dim": [256, 512, 1024, 2048], "num_heads": [8, 16, 32, 64],
                       "num_groups": [8, 16, 32, 64], "window_size": 12, "projection_dim": 1024},
        text_config={"model_type": "bart", "vocab_size": 51289, "d_model": 1024, "encoder_layers": 12,
                     "decoder_layers": 12, "encoder_attention_heads": 16, "decoder_attention_heads": 16,
                     "encoder_ffn_dim": 4096, "decoder_ffn_dim": 4096, "max_position_embeddings": 1024},
    ).save_pretrained(tmp_path / "florence-2-large")
    with torch.device("meta"):
        model = LeRobotXVLAModel(PRESETS["xvla"].with_overrides(florence=str(tmp_path / "florence-2-large")))
    sizes = {k: sum(p.numel() for m in mods for p in m.parameters()) for k, mods in model.components().items()}
    assert sum(sizes.values()) == sum(p.numel() for p in model.parameters())
    assert round(sum(sizes.values()) / 1e8) == 9 and round(sizes["expert"] / 1e6) == 309
    assert len(model.wrap_units()) == 12 + 12 + 24
