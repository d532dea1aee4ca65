"""LeRobot's own FastWAM (``FastWAM``: Wan2.2 video DiT + action DiT in one mixture of transformers) through our
trainer, on a tiny Wan2.2 VAE saved by diffusers, a tiny UMT5 text encoder and tokenizer saved by transformers, on
the CPU (fp32).

Parity: our per-sample loss (our processor + model), averaged, equals ``FastWAMPolicy.forward`` on the batch LeRobot's
own FastWAM pre-processor makes, from the same weights and the same flow draws. The recipe trains through the CLI
on a LeRobotDataset v3 (clips of later frames); its export loads with LeRobot's plain ``FastWAMPolicy.from_pretrained``
and ``select_action`` gives our model's actions; ``loongforge serve``'s policy answers the openpi client; ddp / zero1
/ fsdp2 on 2 gloo ranks give the one-process losses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "embodied" / "lerobot_fastwam_tiny.yaml"
TOL = 1e-5
CAM = "observation.images.cam0"
PUBLISHED_WAN = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"  # where LeRobot's FastWAM reads its VAE (a fixed hub id)


def make_tiny_wan(out: Path) -> Path:
    """A tiny Wan2.2 directory: the VAE (48 latent channels, 16x spatial / 4x temporal, as Wan2.2-TI2V's) saved by
    diffusers, a one-layer UMT5 encoder of width 16 saved by transformers."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1, is_residual=True, in_channels=12,
                     out_channels=12, patch_size=2, scale_factor_spatial=16, temperal_downsample=[False, True, True],
                     latents_mean=[0.1] * 48, latents_std=[1.5] * 48).save_pretrained(out / "vae")
    UMT5EncoderModel(UMT5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                dropout_rate=0.0)).save_pretrained(out / "text_encoder")
    return out


def make_tokenizer(out: Path) -> Path:
    """A character-level tokenizer saved by transformers (UMT5's pad / eos / unk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>", *map(chr, range(32, 127))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                            eos_token="</s>").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The tiny Wan and tokenizer directories, and a Hugging Face cache whose Wan2.2-TI2V-5B-Diffusers snapshot is
    the tiny one (LeRobot reads the VAE from there)."""
    root = tmp_path_factory.mktemp("fastwam")
    wan, tok = make_tiny_wan(root / "wan"), make_tokenizer(root / "tokenizer")
    repo = root / "hub" / ("models--" + PUBLISHED_WAN.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(wan, repo / "snapshots" / ("0" * 40))
    return wan, tok, root / "hub"


@pytest.fixture(scope="module")
def lerobot_hub(dirs):
    """LeRobot's FastWAM reads its VAE from the tiny snapshot (offline)."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(dirs[2]))
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        yield


def _extra(dirs) -> tuple[str, ...]:
    return (f"model.arch.wan={dirs[0]}", f"model.arch.tokenizer={dirs[1]}")


@pytest.fixture(scope="module")
def tiny(dirs):
    from loongforge_embodied.policies.lerobot_fastwam.configuration_lerobot_fastwam import PRESETS
    from loongforge_embodied.policies.lerobot_fastwam.modeling_lerobot_fastwam import LeRobotFastWAMModel
    from loongforge_embodied.policies.lerobot_fastwam.processor_lerobot_fastwam import prepare_batch

    arch = PRESETS["tiny"].with_overrides(wan=str(dirs[0]), tokenizer=str(dirs[1]))
    torch.manual_seed(0)
    model = LeRobotFastWAMModel(arch)
    g = torch.Generator().manual_seed(1)
    b, frames = 3, len(arch.frame_offsets)
    raw = {"images": torch.rand(b, 1, frames, 3, 24, 28, generator=g), "state": torch.randn(b, 2, generator=g),
           "actions": torch.randn(b, arch.chunk_size, 2, generator=g),
           "action_pad": torch.tensor([[False] * 4, [False, False, False, True], [False, True, True, True]]),
           "task": ["push it", "a much longer task than the others", "x"]}
    stats = {"state_mean": torch.tensor([0.1, -0.2]), "state_std": torch.tensor([1.5, 0.7]),
             "action_mean": torch.tensor([0.3, 0.0]), "action_std": torch.tensor([2.0, 0.5])}
    model.set_stats(stats)
    return arch, model, raw, stats, prepare_batch(raw, arch=arch, stats=stats)


def _ds_stats(stats: dict) -> dict:
    return {"observation.state": {"mean": stats["state_mean"], "std": stats["state_std"]},
            "action": {"mean": stats["action_mean"], "std": stats["action_std"]}}


def _lerobot(arch, model, stats):
    """LeRobot's own ``FastWAMPolicy`` with our weights, and its own pre / post-processors for ``stats``."""
    from lerobot.policies.fastwam import FastWAMPolicy, make_fastwam_pre_post_processors
    from loongforge_embodied.policies.lerobot_fastwam.build import fastwam_config

    policy = FastWAMPolicy(fastwam_config(arch, cameras=[CAM]))
    policy.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("stats.")}, strict=True)
    return (policy, *make_fastwam_pre_post_processors(policy.config, dataset_stats=_ds_stats(stats)))


def _draws(seed: int, *, b: int, arch) -> dict[str, torch.Tensor]:
    """``FastWAM._sample_training_targets``'s own draws after ``torch.manual_seed(seed)``: video noise and time,
    then action noise and time."""
    torch.manual_seed(seed)
    video_noise, video_time = torch.randn(b, *arch.latent_shape), torch.rand(b)
    return {"video_noise": video_noise, "video_time": video_time,
            "noise": torch.randn(b, arch.chunk_size, arch.action_dim), "time": torch.rand(b)}


def test_loss_matches_lerobot_policy_forward(tiny, lerobot_hub):
    arch, model, raw, stats, inp = tiny
    policy, pre, _ = _lerobot(arch, model, stats)
    batch = pre({CAM: raw["images"][:, 0], "observation.state": raw["state"], "task": raw["task"],
                 "action": raw["actions"], "action_is_pad": raw["action_pad"]})
    draws = _draws(7, b=3, arch=arch)
    torch.manual_seed(7)
    ref, parts = policy.forward(batch)
    ours = model({**inp, **draws})
    torch.testing.assert_close(ours.mean(), ref, rtol=TOL, atol=0)
    assert parts["loss_video"] > 0 and parts["loss_action"] > 0
    ours.mean().backward()  # NOTE: every trainable weight reaches the loss (what FSDP2 / DDP need)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    assert inp["video"].shape == (3, 3, 5, 32, 64) and inp["input_ids"].shape == (3, arch.tokenizer_max_length)


def test_sampling_matches_lerobot_predict_action_chunk(tiny, lerobot_hub):
    """Our batched ``sample_actions`` from LeRobot's seeded noise equals ``predict_action_chunk`` (one sample at a
    time, its video K/V cached)."""
    arch, model, raw, stats, _ = tiny
    from loongforge_embodied.policies.lerobot_fastwam.processor_lerobot_fastwam import prepare_batch

    policy, pre, post = _lerobot(arch, model, stats)
    frames = {CAM: raw["images"][:, 0, 0], "observation.state": raw["state"], "task": raw["task"]}
    theirs = post(policy.predict_action_chunk(pre(dict(frames))))
    noise = torch.randn(1, arch.chunk_size, arch.action_dim,
                        generator=torch.Generator().manual_seed(policy.config.inference_seed)).expand(3, -1, -1)
    inp = prepare_batch({"images": raw["images"][:, :, 0], "state": raw["state"], "task": raw["task"]}, arch=arch,
                        stats=stats)
    ours = model.eval().unnormalize_actions(model.sample_actions(inp, noise=noise))
    model.train()
    assert ours.shape == theirs.shape == (3, arch.chunk_size, arch.action_dim)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_recompute_keeps_the_loss_and_gradients(tiny):
    import copy

    arch, model, _, _, inp = tiny
    inp = {**inp, **_draws(3, b=3, arch=arch)}
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
    sizes = {k: sum(p.numel() for m in mods for p in m.parameters()) for k, mods in model.components().items()}
    assert sum(sizes.values()) == sum(p.numel() for p in model.parameters())


def test_bf16_frozen_parts_keep_the_loss_close(tiny):
    """``frozen_dtype: bfloat16`` (the published preset's) holds the VAE and text encoder in bf16; the experts stay
    fp32 and the loss stays within bf16's precision of the fp32 one."""
    from loongforge_embodied.policies.lerobot_fastwam.modeling_lerobot_fastwam import LeRobotFastWAMModel

    arch, model, _, _, inp = tiny
    inp = {**inp, **_draws(4, b=3, arch=arch)}
    half = LeRobotFastWAMModel(arch.with_overrides(frozen_dtype="bfloat16"))
    half.load_state_dict(model.state_dict())
    assert next(half.model.vae.parameters()).dtype == next(half.model.text_encoder.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in half.parameters())
    with torch.no_grad():
        torch.testing.assert_close(half(inp), model(inp), rtol=0.05, atol=1e-3)


def make_dataset(root: Path, *, episodes: int = 2, frames: int = 6) -> Path:
    """A tiny LeRobotDataset v3 written by LeRobot itself (random 24x28 frames: resized to 32x64)."""
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


def test_clips_are_read_as_lerobot_reads_them(dataset, dirs):
    """A sample's clip: its frame and the later ones (``frame_offsets``), from LeRobot's dataset and from memory."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from loongforge_embodied.data.dataset import InMemorySource, LeRobotSource
    from loongforge_embodied.policies.lerobot_fastwam.configuration_lerobot_fastwam import PRESETS

    arch = PRESETS["tiny"].with_overrides(frame_stride=2, video_frames=9, chunk_size=4)
    source = LeRobotSource(root=str(dataset), repo_id="local/tiny", arch=arch, cameras=None)
    theirs = LeRobotDataset("local/tiny", root=dataset, delta_timestamps={CAM: [o / 10 for o in arch.frame_offsets]})
    memory = InMemorySource(source)
    for idx in (0, 4, 7):
        item = source[idx]
        assert item["images"].shape == (1, 5, 3, 24, 28)
        torch.testing.assert_close(item["images"][0], theirs[idx][CAM], rtol=0, atol=0)
        torch.testing.assert_close(memory[idx]["images"], item["images"], rtol=0, atol=1e-6)


def test_recipe_trains_on_a_lerobot_dataset_exports_for_lerobot_and_serves(dirs, dataset, lerobot_hub, tmp_path,
                                                                           monkeypatch):
    from lerobot.policies.fastwam import FastWAMPolicy, make_fastwam_pre_post_processors
    from loongforge.cli import main
    from loongforge.metrics import read_metrics
    from loongforge_embodied.eval.server import PolicyServer
    from loongforge_embodied.eval.trained_policy import TrainedPolicy
    from loongforge_embodied.policies.lerobot_fastwam.export import load_model
    from loongforge_embodied.policies.lerobot_fastwam.processor_lerobot_fastwam import prepare_batch
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["train", str(RECIPE), "--output", str(out), *_extra(dirs), "data.format=lerobot",
                     f"data.root={dataset}", "model.freeze=[video]", "logging.tensorboard=false"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 4] and all(np.isfinite(losses))
    hf = out / "hf"
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["type"] == "fastwam" and cfg["text_encoder_model_id"] == str(dirs[0])
    ours = load_model(hf).eval()
    policy = FastWAMPolicy.from_pretrained(hf, strict=True)
    theirs = policy.state_dict()
    assert set(theirs) == {k for k in ours.state_dict() if not k.startswith("stats.")}
    for key, value in theirs.items():
        assert torch.equal(value, ours.state_dict()[key]), key
    # select_action of LeRobot's own policy (its pre/post-processors on the exported statistics) = our model's
    stats = {k: torch.tensor(v) for k, v in json.loads((hf / "loongforge.json").read_text())["stats"].items()}
    pre, post = make_fastwam_pre_post_processors(policy.config, dataset_stats=_ds_stats(stats))
    g = torch.Generator().manual_seed(3)
    frame = {CAM: torch.rand(1, 3, 24, 28, generator=g), "observation.state": torch.randn(1, 2, generator=g),
             "task": ["push the block"]}
    first = post(policy.select_action(pre(dict(frame))))
    noise = torch.randn(1, ours.arch.chunk_size, ours.arch.action_dim,
                        generator=torch.Generator().manual_seed(policy.config.inference_seed))
    raw = {"images": frame[CAM][:, None], "state": frame["observation.state"], "task": frame["task"]}
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
    """2 gloo ranks, ddp / zero1 / fsdp2 (units: the MoT layers), in one launch, reproduce the one-process losses
    over 3 steps."""
    from .strategy_losses import one_and_two_ranks

    single, two = one_and_two_ranks(ranks, tmp_path, env=env, extra=_extra(dirs), recipe_name=RECIPE.name,
                                    strategies=["ddp", "zero1", "fsdp2"])
    for strategy, losses in two["losses"].items():
        assert losses == pytest.approx(single, rel=TOL), (strategy, losses, single)
    assert two["layouts"]["fsdp2"]["placements"] == ["S(0)"] and two["layouts"]["ddp"] == {}


def test_recipes_resolve_and_missing_directories_are_one_line(dirs, tmp_path, capsys):
    from loongforge.cli import main

    assert main(["validate", str(RECIPE), "model.arch.wan=/nowhere/wan"]) == 0
    assert main(["validate", str(RECIPE.with_name("lerobot_fastwam_pusht.yaml"))]) == 0
    capsys.readouterr()
    assert main(["train", str(RECIPE), "--output", str(tmp_path / "run"), "model.arch.wan=/nowhere/wan"]) == 2
    err = capsys.readouterr().err
    assert "key 'model.arch.wan': '/nowhere/wan': no local folder" in err and err.count("\n") == 1, err
    assert main(["train", str(RECIPE), "--output", str(tmp_path / "run2"), f"model.arch.wan={dirs[0]}",
                 "model.arch.tokenizer=/nowhere/tok"]) == 2
    assert "key 'model.arch.tokenizer': '/nowhere/tok': no local folder" in capsys.readouterr().err
    assert main(["validate", str(RECIPE), "model.arch.video_frames=6"]) == 2
    assert "the clip's 5 transitions ((video_frames - 1) / frame_stride) are not a multiple of 4" in \
        capsys.readouterr().err
    assert main(["validate", str(RECIPE), "model.arch.frame_stride=2", "model.arch.video_frames=6"]) == 2
    assert "video_frames - 1 (5) is not a multiple of frame_stride (2)" in capsys.readouterr().err
    assert main(["train", str(RECIPE), "--output", str(tmp_path / "run3"), *_extra(dirs),
                 "model.freeze=[vision]"]) == 2
    assert "lerobot_fastwam has no component vision; allowed: video, action" in capsys.readouterr().err


def test_published_size_is_wan2_2_ti2v_5b():
    """The ``fastwam`` preset's experts on the meta device: the video DiT is Wan2.2-TI2V-5B's (30 layers, 3072 wide),
    the action DiT 30 layers, 1024 wide (attention 3072 wide, as the video's: 1.0B)."""
    from lerobot.policies.fastwam.wan import ActionDiT, WanVideoDiT
    from loongforge_embodied.policies.lerobot_fastwam.build import dit_configs
    from loongforge_embodied.policies.lerobot_fastwam.configuration_lerobot_fastwam import PRESETS

    video, action = dit_configs(PRESETS["fastwam"])
    with torch.device("meta"):
        sizes = [sum(p.numel() for p in m.parameters()) for m in (WanVideoDiT(**video), ActionDiT(**action))]
    assert round(sizes[0] / 1e9) == 5 and round(sizes[1] / 1e8) == 10, sizes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_loss_and_actions_are_the_cpu_ones(tiny):
    """Moved to the GPU, the model feeds FastWAM's inputs to the GPU (its ``device`` follows the weights, the frozen
    VAE and text encoder with them): fp32 loss and sampled actions equal the CPU's."""
    from loongforge_embodied.policies.lerobot_fastwam.modeling_lerobot_fastwam import LeRobotFastWAMModel

    arch, model, _, _, inp = tiny
    torch.backends.cuda.matmul.allow_tf32 = False
    inp = {**inp, **_draws(5, b=3, arch=arch)}
    gpu = LeRobotFastWAMModel(arch)
    gpu.load_state_dict(model.state_dict())
    gpu.to("cuda")
    assert gpu.model.device.type == "cuda" and next(gpu.model.vae.parameters()).is_cuda
    with torch.no_grad():
        cpu_loss = model(inp)
        loss = gpu({k: v.cuda() for k, v in inp.items()})
    torch.testing.assert_close(loss.cpu(), cpu_loss, rtol=1e-4, atol=1e-6)
    noise = inp["noise"]
    ours = gpu.eval().sample_actions({k: v.cuda() for k, v in inp.items()}, noise=noise.cuda())
    torch.testing.assert_close(ours.cpu(), model.eval().sample_actions(inp, noise=noise), rtol=1e-4, atol=1e-5)
    model.train()
