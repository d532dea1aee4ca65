"""LeRobot's own SmolVLA (``VLAFlowMatching``) through our trainer, on a tiny SmolVLM saved by transformers, on the
CPU (fp32).

Parity: our per-sample loss (our processor + model) equals ``SmolVLAPolicy.forward(batch, reduction="none")`` on
the batch LeRobot's own SmolVLA pre-processor makes, from the same weights, noise and time; our sampler equals
``predict_action_chunk``. The recipe trains through the CLI on a LeRobotDataset v3; its export loads with LeRobot's
plain ``SmolVLAPolicy.from_pretrained`` and ``select_action`` gives our model's actions; ``loongforge serve``'s
policy answers the openpi client; ddp / zero1 / fsdp2 on 2 gloo ranks give the one-process losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "embodied" / "lerobot_smolvla_tiny.yaml"
TOL = 1e-5
SPECIAL = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
           "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}


def make_tiny_vlm(out: Path) -> Path:
    """A tiny SmolVLM directory saved by transformers: config (4 Llama layers, 2 vision layers at 32², pixel
    shuffle 2) + processor (a character-level tokenizer with SmolVLM's special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, SmolVLMConfig
    from transformers.models.smolvlm import SmolVLMImageProcessor, SmolVLMProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    words = ["<unk>", "<|endoftext|>", "<|im_start|>", *SPECIAL.values(), "\n", *map(chr, range(32, 127))]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                 bos_token="<|im_start|>", eos_token="<end_of_utterance>", extra_special_tokens=SPECIAL)
    SmolVLMConfig(text_config={"model_type": "llama", "vocab_size": len(vocab), "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 16},
                  vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
                  scale_factor=2, image_token_id=vocab["<image>"]).save_pretrained(out)
    image = SmolVLMImageProcessor(max_image_size={"longest_edge": 32}, size={"longest_edge": 32})
    SmolVLMProcessor(image_processor=image, tokenizer=hf, video_processor=SmolVLMVideoProcessor(),
                     image_seq_len=4).save_pretrained(out)
    return out


def make_dataset(root: Path, *, episodes: int = 2, frames: int = 6) -> Path:
    """A tiny LeRobotDataset v3 written by LeRobot itself (random 24x28 frames: resized with padding to 32²)."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {
        "observation.image": {"dtype": "image", "shape": (24, 28, 3), "names": ["height", "width", "channel"]},
        "observation.state": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
        "action": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
    }
    ds = LeRobotDataset.create("local/tiny", fps=10, root=root, features=features, use_videos=False)
    rng = np.random.default_rng(0)
    for _ in range(episodes):
        for _ in range(frames):
            ds.add_frame({"observation.image": rng.integers(0, 255, (24, 28, 3), dtype=np.uint8),
                          "observation.state": rng.standard_normal(2).astype(np.float32),
                          "action": rng.standard_normal(2).astype(np.float32), "task": "push the block"})
        ds.save_episode()
    ds.finalize()
    return root


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("smolvlm") / "tiny")


@pytest.fixture(scope="module")
def tiny(vlm):
    from loongforge_embodied.policies.lerobot_smolvla.configuration_lerobot_smolvla import PRESETS
    from loongforge_embodied.policies.lerobot_smolvla.modeling_lerobot_smolvla import LeRobotSmolVLAModel
    from loongforge_embodied.policies.lerobot_smolvla.processor_lerobot_smolvla import prepare_batch

    arch = PRESETS["tiny"].with_overrides(vlm=str(vlm))
    torch.manual_seed(0)
    model = LeRobotSmolVLAModel(arch)
    g = torch.Generator().manual_seed(1)
    b = 3
    # NOTE: 24x28 frames exercise LeRobot's resize-with-pad; tasks of different lengths the prompt padding; the
    # last sample's chunk runs past its episode (masked steps).
    raw = {"images": torch.rand(b, 1, 3, 24, 28, generator=g), "state": torch.randn(b, 2, generator=g),
           "actions": torch.randn(b, arch.chunk_size, 2, generator=g),
           "action_pad": torch.tensor([[False] * 4, [False] * 4, [False, False, True, True]]),
           "noise": torch.randn(b, arch.chunk_size, 2, generator=g), "time": torch.rand(b, generator=g) * 0.9 + 0.05,
           "task": ["push it", "a much longer task than the others", "x"]}
    stats = {"state_mean": torch.tensor([0.1, -0.2]), "state_std": torch.tensor([1.5, 0.7]),
             "action_mean": torch.tensor([0.3, 0.0]), "action_std": torch.tensor([2.0, 0.5])}
    model.set_stats(stats)
    return arch, model, raw, stats, prepare_batch(raw, arch=arch, stats=stats)


def _lerobot(arch, model, stats):
    """LeRobot's own ``SmolVLAPolicy`` with our weights, and its own pre-processor for ``stats``."""
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors
    from loongforge_embodied.policies.lerobot_smolvla.build import smolvla_config

    config = smolvla_config(arch, cameras=["observation.images.cam0"])
    policy = SmolVLAPolicy(config)
    policy.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("stats.")}, strict=True)
    ds_stats = {"observation.state": {"mean": stats["state_mean"], "std": stats["state_std"]},
                "action": {"mean": stats["action_mean"], "std": stats["action_std"]}}
    pre, _ = make_smolvla_pre_post_processors(config, dataset_stats=ds_stats)
    return policy, pre


def _frames(raw) -> dict:
    return {"observation.images.cam0": raw["images"][:, 0], "observation.state": raw["state"], "task": raw["task"]}


def test_loss_matches_lerobot_policy_forward(tiny):
    arch, model, raw, stats, inp = tiny
    policy, pre = _lerobot(arch, model, stats)
    batch = pre({**_frames(raw), "action": raw["actions"], "action_is_pad": raw["action_pad"]})
    ref, _ = policy.forward(batch, noise=inp["noise"], time=inp["time"], reduction="none")
    with torch.no_grad():
        ours = model(inp)
    torch.testing.assert_close(ours, ref.detach(), rtol=TOL, atol=0)
    torch.testing.assert_close(inp["lang_tokens"], batch["observation.language.tokens"], rtol=0, atol=0)
    assert inp["lang_mask"].sum(1).unique().numel() == 3  # three prompt lengths, right-padded to the longest
    assert inp["noise"].shape[-1] == arch.max_action_dim and not inp["actions"][..., 2:].any()


def test_sampling_matches_lerobot_predict_action_chunk(tiny):
    """Inference under the cache adaptation: our ``sample_actions`` equals ``predict_action_chunk`` on the same
    weights, frames, prompt and noise (LeRobot's KV-cached Euler loop, both)."""
    from loongforge_embodied.policies.lerobot_smolvla.build import adapted

    arch, model, raw, stats, inp = tiny
    policy, pre = _lerobot(arch, model, stats)
    noise = torch.randn(3, arch.chunk_size, arch.max_action_dim, generator=torch.Generator().manual_seed(5))
    with pytest.raises(RuntimeError, match="smolvla-cache-crop"):
        model.sample_actions(inp, noise=noise)
    with adapted():
        theirs = policy.predict_action_chunk(pre(_frames(raw)), noise=noise)
        ours = model.eval().sample_actions(inp, noise=noise)
    model.train()
    assert ours.shape == theirs.shape == (3, arch.chunk_size, arch.action_dim)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_recompute_and_freeze_keep_the_losses(tiny):
    """``recompute: full`` (vision layers + the joint stack as checkpoints) gives the same loss and gradients;
    LeRobot's own frozen parts (lm_head, final norm, last VLM layer) stay frozen."""
    from loongforge_embodied.policies.lerobot_smolvla.modeling_lerobot_smolvla import LeRobotSmolVLAModel

    arch, model, _, _, inp = tiny
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any("lm_head" in n for n in frozen) and any(".text_model.layers.3." in n for n in frozen)
    assert not any(".text_model.layers.2." in n for n in frozen)
    other = LeRobotSmolVLAModel(arch)
    other.load_state_dict(model.state_dict())
    other.enable_activation_checkpointing()
    grads = []
    for m in (model, other):
        m.zero_grad(set_to_none=True)
        loss = m(inp)
        loss.sum().backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=TOL, atol=0)
    assert grads[0][1].keys() == grads[1][1].keys()
    for name, g in grads[0][1].items():
        torch.testing.assert_close(g, grads[1][1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("lerobot") / "tiny")


def test_recipe_trains_on_a_lerobot_dataset_exports_for_lerobot_and_serves(vlm, dataset, tmp_path, monkeypatch):
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors
    from loongforge.cli import main
    from loongforge.metrics import read_metrics
    from loongforge_embodied.eval.server import PolicyServer
    from loongforge_embodied.eval.trained_policy import TrainedPolicy
    from loongforge_embodied.policies.lerobot_smolvla.build import adapted
    from loongforge_embodied.policies.lerobot_smolvla.export import load_model
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["train", str(RECIPE), "--output", str(out), f"model.arch.vlm={vlm}", "data.format=lerobot",
                     f"data.root={dataset}", "model.freeze=[vision]", "logging.tensorboard=false"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 4] and all(np.isfinite(losses))
    hf = out / "hf"
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["type"] == "smolvla" and cfg["vlm_model_name"] == str(vlm)
    ours = load_model(hf).eval()
    policy = SmolVLAPolicy.from_pretrained(hf, strict=True)
    theirs = policy.state_dict()
    assert set(theirs) == {k for k in ours.state_dict() if not k.startswith("stats.")}
    for key, value in theirs.items():
        assert torch.equal(value, ours.state_dict()[key]), key
    # select_action of LeRobot's own policy (its pre/post-processors on the exported statistics) = our model's
    stats = {k: torch.tensor(v) for k, v in json.loads((hf / "loongforge.json").read_text())["stats"].items()}
    pre, post = make_smolvla_pre_post_processors(policy.config, dataset_stats={
        "observation.state": {"mean": stats["state_mean"], "std": stats["state_std"]},
        "action": {"mean": stats["action_mean"], "std": stats["action_std"]}})
    g = torch.Generator().manual_seed(3)
    frame = {"observation.image": torch.rand(3, 24, 28, generator=g), "observation.state": torch.randn(2, generator=g),
             "task": "push the block"}
    noise = torch.randn(1, ours.arch.chunk_size, ours.arch.max_action_dim, generator=g)
    from loongforge_embodied.policies.lerobot_smolvla.processor_lerobot_smolvla import prepare_batch

    raw = {"images": frame["observation.image"][None, None], "state": frame["observation.state"][None],
           "task": [frame["task"]]}
    with adapted():
        first = post(policy.select_action(pre(dict(frame)), noise=noise))
        chunk = ours.unnormalize_actions(ours.sample_actions(prepare_batch(raw, arch=ours.arch, stats=stats),
                                                             noise=noise))
    torch.testing.assert_close(first, chunk[:, 0], rtol=0, atol=1e-5)
    # served: the openpi client gets the chunk of our model for the same request (noise seeded by the request)
    served = TrainedPolicy.load(out)
    request = {"observation.image": (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8),
               "observation.state": np.array([0.5, -0.5], np.float32), "prompt": "push the block"}
    with PolicyServer(served, port=0, batch_wait_s=0.0) as server:
        client = WebsocketClientPolicy(host=server.address)
        assert client.get_server_metadata()["features"]["observation.image"]["shape"] == [32, 32, 3]
        actions = client.infer(request)["actions"]
    assert actions.shape == (ours.arch.chunk_size, 2) and np.isfinite(actions).all()
    np.testing.assert_allclose(actions, served.infer_batch([request])[0]["actions"], rtol=0, atol=1e-6)


def test_eval_pusht_records_the_envs_episodes_and_a_missing_extra_is_one_line(tiny, tmp_path, monkeypatch, capsys):
    """``loongforge eval --env pusht`` of a SmolVLA export runs the closed loop on the CPU: each episode's success,
    return and length in ``summary.json`` are what gym-pusht gives for the policy's actions (the episodes rolled out
    again here); without the ``[eval]`` extra it is one line naming it."""
    import sys

    from .pusht_closed_loop import check_recorded, eval_pusht, export_for_pusht

    model = tiny[1]
    export = export_for_pusht(model, policy="lerobot_smolvla", out=tmp_path / "hf")
    check_recorded(export, eval_pusht(export, tmp_path / "eval"), policy="lerobot_smolvla")
    from loongforge.cli import main

    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "openpi_client", None)  # NOTE: as if the [eval] extra were not installed
    assert main(["eval", str(export), "--env", "pusht", "--episodes", "1", "--output", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'openpi_client'" in err and "loongforge-embodied[eval]" in err, err


@pytest.mark.slow
def test_ddp_zero1_and_fsdp2_match_single_process(vlm, tmp_path, env, ranks):
    """2 gloo ranks, ddp / zero1 / fsdp2 (units: the vision layers; the rest in the root unit), in one launch,
    reproduce the one-process losses over 3 steps."""
    from .strategy_losses import one_and_two_ranks

    extra = (f"model.arch.vlm={vlm}",)
    single, two = one_and_two_ranks(ranks, tmp_path, env=env, extra=extra, recipe_name=RECIPE.name,
                                    strategies=["ddp", "zero1", "fsdp2"])
    for strategy, losses in two["losses"].items():
        assert losses == pytest.approx(single, rel=TOL), (strategy, losses, single)
    assert two["layouts"]["fsdp2"]["placements"] == ["S(0)"] and two["layouts"]["ddp"] == {}


def test_recipes_resolve_and_a_missing_vlm_is_one_line(vlm, tmp_path, capsys):
    """A recipe validates without its VLM (it names it for the machine that trains); training without it is one line
    naming ``model.arch.vlm`` before anything is built."""
    from loongforge.cli import main

    assert main(["validate", str(RECIPE), "model.arch.vlm=/nowhere/smolvlm"]) == 0
    assert main(["validate", str(RECIPE.with_name("lerobot_smolvla_pusht.yaml"))]) == 0
    capsys.readouterr()
    assert main(["train", str(RECIPE), "--output", str(tmp_path / "run"), "model.arch.vlm=/nowhere/smolvlm"]) == 2
    err = capsys.readouterr().err
    assert "key 'model.arch.vlm': '/nowhere/smolvlm': no local folder" in err and err.count("\n") == 1, err
    assert main(["validate", str(RECIPE), f"model.arch.vlm={vlm}", "model.arch.attention_mode=sparse"]) == 2
    assert "attention_mode 'sparse' (allowed: cross_attn, self_attn)" in capsys.readouterr().err


def test_published_size_is_smolvlas_450m(vlm, tmp_path):
    """The ``smolvla`` preset on SmolVLM2-500M-Video-Instruct's config (its sizes, written here by transformers;
    the tiny tokenizer stands in for its processor), on the meta device: 450.0M parameters, the ~100M expert
    LeRobot's SmolVLA trains (the recipe freezes vision + language)."""
    import shutil

    from loongforge_embodied.policies.lerobot_smolvla.configuration_lerobot_smolvla import PRESETS
    from loongforge_embodied.policies.lerobot_smolvla.modeling_lerobot_smolvla import LeRobotSmolVLAModel
    from transformers import SmolVLMConfig

    real = shutil.copytree(vlm, tmp_path / "smolvlm2-500m")
    SmolVLMConfig(text_config={"model_type": "llama", "vocab_size": 49280, "hidden_size": 960,
                               "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
                               "num_key_value_heads": 5, "head_dim": 64, "rope_theta": 100000.0},
                  vision_config={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                                 "num_attention_heads": 12, "image_size": 512, "patch_size": 16},
                  scale_factor=4, image_token_id=4).save_pretrained(real)
    with torch.device("meta"):
        model = LeRobotSmolVLAModel(PRESETS["smolvla"].with_overrides(vlm=str(real), num_cameras=3, state_dim=6,
                                                                      action_dim=6))
    sizes = {k: sum(p.numel() for m in mods for p in m.parameters()) for k, mods in model.components().items()}
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 450.0
    assert round(sizes["expert"] / 1e6) == 100 and len(model.model.vlm_with_expert.get_vlm_model().text_model.layers) == 16


def test_a_lerobot_smolvla_checkpoint_loads_without_our_sidecar(tiny, tmp_path):
    """``model.load`` / ``serve`` of a directory LeRobot wrote (``config.json`` + ``model.safetensors`` only): the
    arch is read back from ``SmolVLAConfig``'s fields, the weights strictly."""
    from loongforge.errors import CheckpointError
    from loongforge_embodied.policies.lerobot_smolvla.export import (
        SIDECAR,
        arch_from_dir,
        load_model,
        write_pretrained,
    )

    arch, model, *_ = tiny
    out = write_pretrained(tmp_path / "hf", arch=arch, weights=model.state_dict(),
                           features={"cameras": ["observation.images.top"]})
    (out / SIDECAR).unlink()
    assert arch_from_dir(out) == arch
    loaded = load_model(out).state_dict()
    for key, value in model.state_dict().items():
        if not key.startswith("stats."):
            assert torch.equal(loaded[key], value), key
    (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()), "type": "pi05"}))
    with pytest.raises(CheckpointError, match="not a smolvla config LeRobot writes"):
        arch_from_dir(out)
