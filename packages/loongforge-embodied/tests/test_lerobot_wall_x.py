"""LeRobot's own Wall-X (``Qwen2_5_VLMoEForAction``) through our trainer, on a tiny Wall-X directory saved by
transformers, on the CPU (fp32).

Parity: our loss (our processor + model) equals ``WallXPolicy.forward``'s on the batch LeRobot's own pre-processor
makes, from the same weights, noise and flow time; the export loads with LeRobot's plain
``WallXPolicy.from_pretrained`` and ``select_action`` (LeRobot's mixed bf16 precision, which its sampler requires)
gives our model's action in that same precision.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

TOL = 1e-5
SPECIAL = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
           "vision_end_token": "<|vision_end|>"}
WALL_X_TOKENS = ["<|im_start|>", "<|im_end|>", "<|propri|>", "<|action|>", "<|action_fast|>"]
RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "embodied" / "lerobot_wall_x_tiny.yaml"


def make_tiny_wall_x(out: Path) -> Path:
    """A tiny Wall-X directory saved by transformers: LeRobot's Wall-X Qwen2.5-VL config (2 decoder layers of 64 with
    a prompt and an action expert, 2 vision blocks, patch 14, merge 2; state / action widths 8) + processor (a
    character-level tokenizer with Qwen2.5-VL's and Wall-X's special tokens)."""
    from lerobot.policies.wall_x.qwen_model import Qwen2_5_VLConfig
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    words = ["<unk>", "<|endoftext|>", *SPECIAL.values(), *WALL_X_TOKENS, "\n", *map(chr, range(32, 127))]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                 eos_token="<|im_end|>", extra_special_tokens=SPECIAL)
    hf.add_tokens(WALL_X_TOKENS, special_tokens=True)
    expert = {"hidden_size": 64, "intermediate_size": 128, "hidden_act": "silu"}
    Qwen2_5_VLConfig(text_config={"vocab_size": len(vocab), "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]},
                                  "num_experts": 2, "experts": [expert, expert], "dim_inputs": [64, 64],
                                  "mlp_moe": True, "dof_config": {"arm": 6, "gripper": 2},
                                  "bos_token_id": vocab["<|endoftext|>"], "eos_token_id": vocab["<|im_end|>"]},
                     vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                    "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                                    "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]},
                     image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
                     vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"],
                     tie_word_embeddings=True, agent_pos_config={"arm": 6, "gripper": 2}).save_pretrained(out)
    image = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2)
    video = Qwen2VLVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2)
    Qwen2_5_VLProcessor(image_processor=image, tokenizer=hf, video_processor=video).save_pretrained(out)
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_wall_x(tmp_path_factory.mktemp("wall_x") / "tiny")


STATS = {"state_mean": torch.tensor([0.5, -1.0]), "state_std": torch.tensor([2.0, 0.5]),
         "action_mean": torch.tensor([-0.5, 1.0]), "action_std": torch.tensor([1.5, 0.25])}


@pytest.fixture(scope="module")
def tiny(base):
    from loongforge_embodied.policies.lerobot_wall_x.adaptations import adapted
    from loongforge_embodied.policies.lerobot_wall_x.configuration_lerobot_wall_x import PRESETS
    from loongforge_embodied.policies.lerobot_wall_x.modeling_lerobot_wall_x import LeRobotWallXModel

    arch = PRESETS["tiny"].with_overrides(base=str(base))
    torch.manual_seed(0)
    model = LeRobotWallXModel(arch)
    model.set_stats(STATS)
    g = torch.Generator().manual_seed(1)
    b = 3
    # NOTE: 24x28 frames exercise the resize; tasks of different lengths the prompt padding
    raw = {"images": torch.rand(b, 1, 3, 24, 28, generator=g), "state": torch.randn(b, 2, generator=g),
           "actions": torch.randn(b, arch.chunk_size, 2, generator=g),
           "task": ["push it", "a much longer task than the others.", "x"]}
    # NOTE: one thread: on a shared 2-core machine more threads make these tiny matmuls far slower (spin-waiting)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with adapted():  # NOTE: LeRobot 0.6.1's Wall-X under the installed transformers (what a job applies)
            yield arch, model, raw
    finally:
        torch.set_num_threads(threads)


def _lerobot(path: Path, model=None):
    """LeRobot's own ``WallXPolicy`` of an export and its pre / post-processors (``make_wall_x_pre_post_processors``
    with the dataset statistics); with ``model``: in fp32 with our weights (LeRobot casts to bf16 as it builds)."""
    from lerobot.policies.wall_x.modeling_wall_x import WallXPolicy
    from lerobot.policies.wall_x.processor_wall_x import make_wall_x_pre_post_processors

    policy = WallXPolicy.from_pretrained(path)
    if model is not None:
        policy.float()
        policy.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("stats.")},
                               strict=True)
    stats = {"observation.state": {"mean": STATS["state_mean"], "std": STATS["state_std"]},
             "action": {"mean": STATS["action_mean"], "std": STATS["action_std"]}}
    pre, post = make_wall_x_pre_post_processors(policy.config, dataset_stats=stats)
    return policy, pre, post


def _frames(raw) -> dict:
    return {"observation.images.cam0": raw["images"][:, 0], "observation.state": raw["state"], "task": raw["task"]}


@pytest.fixture(scope="module")
def export(tiny, tmp_path_factory) -> Path:
    from loongforge_embodied.policies.lerobot_wall_x.export import write_pretrained

    arch, model, _ = tiny
    return write_pretrained(tmp_path_factory.mktemp("wall_x_export") / "export", arch=arch,
                            weights=model.state_dict(), features={"cameras": ["observation.images.cam0"]})


def test_loss_matches_lerobot_wall_x_policy(tiny, export):
    """Same weights, batch, noise and flow time: the mean of our per-sample losses is ``WallXPolicy.forward``'s
    (LeRobot's own policy and pre-processor, in fp32)."""
    from loongforge_embodied.policies.lerobot_wall_x.processor_lerobot_wall_x import prepare_batch
    from torch.distributions import Beta

    arch, model, raw = tiny
    policy, pre, _ = _lerobot(export, model)
    policy.train()
    model.train()
    theirs_in = pre({**_frames(raw), "action": raw["actions"]})
    b = len(raw["task"])
    # NOTE: the action head draws its flow time (Beta(1.5, 1)) then its noise (randn): replay both under one seed
    torch.manual_seed(7)
    s = Beta(torch.tensor(1.5), torch.tensor(1.0)).sample([b])
    noise = torch.randn(b, arch.chunk_size, arch.max_action_dim)
    torch.manual_seed(7)
    theirs, _ = policy.forward(theirs_in)
    ours_in = prepare_batch({**raw, "noise": noise[..., :2], "time": 1 - (1 - s) * 0.999}, arch=arch, stats=STATS)
    ours_in["noise"] = noise
    expect = policy.preprocess_inputs(theirs_in, compute_position_ids=True)
    for key in ("input_ids", "attention_mask", "pixel_values", "position_ids", "proprioception", "dof_mask"):
        assert torch.equal(ours_in[key], expect[key]), key
    assert torch.equal(ours_in["actions"], expect["action_chunk"])
    per_sample = model(ours_in)
    assert per_sample.shape == (b,)
    ours_f, theirs_f = float(per_sample.mean().detach()), float(theirs.detach())
    assert abs(ours_f - theirs_f) <= TOL * abs(theirs_f), (ours_f, theirs_f)
    per_sample.mean().backward()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == [] and all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_recompute_keeps_loss_and_gradients(tiny):
    """``recompute: full`` (transformers' checkpointing of the vision blocks and decoder layers) gives the same
    per-sample losses and gradients."""
    from loongforge_embodied.policies.lerobot_wall_x.modeling_lerobot_wall_x import LeRobotWallXModel
    from loongforge_embodied.policies.lerobot_wall_x.processor_lerobot_wall_x import prepare_batch

    arch, model, raw = tiny
    g = torch.Generator().manual_seed(4)
    inp = prepare_batch({**raw, "noise": torch.randn(3, arch.chunk_size, 2, generator=g),
                         "time": torch.rand(3, generator=g)}, arch=arch, stats=STATS)
    other = LeRobotWallXModel(arch)
    other.load_state_dict(model.state_dict())
    other.enable_activation_checkpointing()
    grads = []
    for m in (model, other):
        m.train()
        m.zero_grad(set_to_none=True)
        loss = m(inp)
        loss.sum().backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=TOL, atol=0)
    assert grads[0][1].keys() == grads[1][1].keys() and len(grads[0][1]) == len(list(model.parameters()))
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grad, grads[1][1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_export_loads_in_lerobot_and_select_action_matches(tiny, export):
    """``WallXPolicy.from_pretrained(export)`` (LeRobot's plain loader, which casts to its mixed bf16) + LeRobot's
    pre / post-processors return our sampled chunk's first action, with our model in the same precision
    (``to_bfloat16_for_selected_params``) and the same sampling noise; our own loader round-trips the export."""
    from loongforge_embodied.policies.lerobot_wall_x.export import load_model
    from loongforge_embodied.policies.lerobot_wall_x.processor_lerobot_wall_x import prepare_batch

    arch, model, raw = tiny
    policy, pre, post = _lerobot(export)
    sd = model.state_dict()
    theirs_sd = policy.state_dict()
    assert set(theirs_sd) == {k for k in sd if not k.startswith("stats.")}
    assert all(torch.equal(v, sd[k].to(v.dtype)) for k, v in theirs_sd.items())
    loaded = load_model(export)
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())
    # NOTE: LeRobot's order: cast to its mixed precision, then load (the fp32 parts keep every bit)
    loaded.model.to_bfloat16_for_selected_params()
    loaded.load_state_dict(sd)
    loaded.eval()
    # NOTE: two samples of different prompt lengths (padding) keep LeRobot's 10 bf16 sampling steps cheap
    raw = {k: v[1:] for k, v in raw.items()}
    obs = {k: v for k, v in raw.items() if k != "actions"}
    torch.manual_seed(3)
    ours = loaded.unnormalize_actions(loaded.sample_actions(prepare_batch(obs, arch=arch, stats=STATS)))
    torch.manual_seed(3)
    theirs = post(policy.select_action(pre(_frames(raw))))
    assert theirs.shape == (len(raw["task"]), 2)
    torch.testing.assert_close(theirs, ours[:, 0], rtol=TOL, atol=TOL)


def test_recipe_trains_exports_for_lerobot_serves_and_a_missing_base_is_one_line(base, tmp_path, monkeypatch, capsys):
    """The tiny recipe trains through the CLI (synthetic frames) and writes an export LeRobot's ``WallXPolicy`` loads
    with our weights and ``loongforge serve``'s policy answers the openpi client; the published recipe validates;
    training without the Wall-X directory, or with widths it does not have, is one line naming the key."""
    from lerobot.policies.wall_x.modeling_wall_x import WallXPolicy
    from loongforge.cli import main
    from loongforge.metrics import read_metrics
    from loongforge_embodied.eval.server import PolicyServer
    from loongforge_embodied.eval.trained_policy import TrainedPolicy
    from loongforge_embodied.policies.lerobot_wall_x.adaptations import adapted
    from loongforge_embodied.policies.lerobot_wall_x.export import load_model
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["validate", str(RECIPE.with_name("lerobot_wall_x_pusht.yaml"))]) == 0
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["train", str(RECIPE), "--output", str(out), f"model.arch.base={base}", "logging.tensorboard=false"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses)))
    ours = load_model(out / "hf").state_dict()
    with adapted():
        theirs = WallXPolicy.from_pretrained(out / "hf").state_dict()
    assert set(theirs) == {k for k in ours if not k.startswith("stats.")}
    assert all(torch.equal(v, ours[k].to(v.dtype)) for k, v in theirs.items())
    # served: the openpi client gets the chunk of our model for the same request (noise seeded by the request)
    served = TrainedPolicy.load(out)
    features = served.metadata()["features"]
    request = {k: (np.random.default_rng(0).random(f["shape"]) * 255).astype(np.uint8) if len(f["shape"]) == 3
               else np.linspace(-0.5, 0.5, f["shape"][0], dtype=np.float32) for k, f in features.items()}
    request["prompt"] = "push the block"
    with adapted(), PolicyServer(served, port=0, batch_wait_s=0.0) as server:
        actions = WebsocketClientPolicy(host=server.address).infer(request)["actions"]
        np.testing.assert_allclose(actions, served.infer_batch([request])[0]["actions"], rtol=0, atol=1e-6)
    assert actions.shape == (4, 2) and np.isfinite(actions).all()
    capsys.readouterr()
    for override, expect in ((f"model.arch.base={tmp_path / 'nowhere'}", "key 'model.arch.base': '"),
                             ("model.arch.max_action_dim=6", "key 'model.arch.max_action_dim': 6 is not the width")):
        assert main(["train", str(RECIPE), "--output", str(tmp_path / "bad"), f"model.arch.base={base}", override]) == 2
        err = capsys.readouterr().err
        assert expect in err and err.count("\n") == 1, err


def test_camera_keys_come_from_the_dataset_and_name_the_cameras_in_the_prompt(base, tmp_path):
    """On a LeRobot dataset the arch takes the run's camera keys (``data.cameras`` or every image feature): Wall-X's
    prompt names them, as LeRobot's prompt does for the export's keys."""
    import json
    from types import SimpleNamespace

    from loongforge_embodied.policies import resolve_arch
    from loongforge_embodied.policies.lerobot_wall_x.processor_lerobot_wall_x import _Preprocessor

    feats = {"observation.images.face_view": {"dtype": "video", "shape": [3, 32, 32]},
             "observation.images.top": {"dtype": "image", "shape": [3, 32, 32]},
             "observation.state": {"dtype": "float32", "shape": [2]}, "action": {"dtype": "float32", "shape": [2]}}
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "info.json").write_text(json.dumps({"features": feats}))
    model = SimpleNamespace(policy="lerobot_wall_x", preset="tiny", arch={"base": str(base)})
    data = SimpleNamespace(format="lerobot", root=str(tmp_path), cameras=None, state_key="observation.state")
    arch = resolve_arch(model, data)
    assert arch.cameras() == ["observation.images.face_view", "observation.images.top"] and arch.num_cameras == 2
    data.cameras = ["observation.images.top"]
    arch = resolve_arch(model, data)
    assert arch.cameras() == ["observation.images.top"] and arch.num_cameras == 1
    prep = _Preprocessor(arch)
    batch = {"observation.images.top": torch.rand(1, 3, 32, 32), "observation.state": torch.zeros(1, 2),
             "task": ["push it."]}
    text = "".join(prep.model.processor.tokenizer.convert_ids_to_tokens(prep(batch)["input_ids"][0].tolist()))
    assert "Observation: top view: <|vision_start|>" in text, text

@pytest.mark.slow
def test_ddp_zero1_and_fsdp2_match_single_process(base, tmp_path, env, ranks):
    """2 gloo ranks, ddp / zero1 / fsdp2 (units: vision blocks, decoder layers), in one launch, reproduce the
    one-process losses over 3 steps."""
    from .strategy_losses import one_and_two_ranks

    extra = (f"model.arch.base={base}",)
    single, two = one_and_two_ranks(ranks, tmp_path, env=env, extra=extra, recipe_name=RECIPE.name,
                                    strategies=["ddp", "zero1", "fsdp2"])
    for strategy, losses in two["losses"].items():
        assert losses == pytest.approx(single, rel=TOL), (strategy, losses, single)
