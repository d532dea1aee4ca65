"""LeRobot's own GR00T N1.7 (``GR00TN17``) through our trainer, on a tiny Qwen3-VL saved by transformers, on the CPU
(fp32).

Parity: our loss (our processor + model) equals ``GrootPolicy.forward``'s on the batch LeRobot's own N1.7 processor
steps make, from the same weights, noise and flow time; the export loads with LeRobot's plain
``GrootPolicy.from_pretrained`` and ``select_action`` gives our model's actions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

TOL = 1e-5
SPECIAL = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
           "vision_end_token": "<|vision_end|>"}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == "
            "'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
            "<|im_end|>\n{% endfor %}")


def make_tiny_qwen3_vl(out: Path) -> Path:
    """A tiny Qwen3-VL directory saved by transformers: config (4 text layers of 64, 2 vision blocks, patch 16,
    merge 2) + processor (a character-level tokenizer with Qwen3-VL's special tokens and a minimal chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3VLConfig
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", *SPECIAL.values(), "\n", *map(chr, range(32, 127))]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                 eos_token="<|im_end|>", extra_special_tokens=SPECIAL)
    hf.chat_template = TEMPLATE
    Qwen3VLConfig(text_config={"vocab_size": len(vocab), "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 16, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                                "mrope_interleaved": True}},
                  vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                 "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                                 "temporal_patch_size": 2, "deepstack_visual_indexes": [1],
                                 "num_position_embeddings": 64},
                  image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
                  vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"],
                  tie_word_embeddings=True).save_pretrained(out)
    image = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                  size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64})
    video = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    Qwen3VLProcessor(image_processor=image, tokenizer=hf, video_processor=video, chat_template=TEMPLATE).save_pretrained(out)
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3vl") / "tiny")


STATS = {"state_min": torch.tensor([-1.0, -2.0]), "state_max": torch.tensor([1.5, 2.0]),
         "action_min": torch.tensor([-1.0, -3.0]), "action_max": torch.tensor([2.0, 1.0])}


@pytest.fixture(scope="module")
def tiny(vlm):
    from loongforge_embodied.policies.lerobot_groot.configuration_lerobot_groot import PRESETS
    from loongforge_embodied.policies.lerobot_groot.modeling_lerobot_groot import LeRobotGrootModel

    arch = PRESETS["tiny"].with_overrides(vlm=str(vlm))
    torch.manual_seed(0)
    model = LeRobotGrootModel(arch)
    model.set_stats(STATS)
    g = torch.Generator().manual_seed(1)
    b = 3
    # NOTE: 24x28 frames exercise the crop / resize; tasks of different lengths the prompt padding; the last
    # sample's chunk runs past its episode (masked steps).
    raw = {"images": torch.rand(b, 1, 3, 24, 28, generator=g), "state": torch.randn(b, 2, generator=g),
           "actions": torch.randn(b, arch.chunk_size, 2, generator=g),
           "action_pad": torch.tensor([[False] * 4, [False] * 4, [False, False, True, True]]),
           "task": ["push it", "a much longer task than the others", "x"]}
    return arch, model, raw


def _lerobot(arch, model, base: Path):
    """LeRobot's own ``GrootPolicy`` built from a GR00T N1.7 directory of our weights, and LeRobot's N1.7 pack /
    VLM-encode steps as ``make_groot_pre_post_processors`` chains them (the backbone's processor from the tiny
    directory)."""
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from lerobot.policies.groot.processor_groot import GrootN17PackInputsStep, GrootN17VLMEncodeStep
    from lerobot.processor import AddBatchDimensionProcessorStep, PolicyProcessorPipeline
    from loongforge_embodied.policies.lerobot_groot.build import policy_config

    model._groot_model.save_pretrained(base)
    policy = GrootPolicy(policy_config(arch, base=str(base), cameras=["observation.images.cam0"]))
    policy.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("stats.")}, strict=True)
    stats = {"observation.state": {"min": STATS["state_min"], "max": STATS["state_max"]},
             "action": {"min": STATS["action_min"], "max": STATS["action_max"]}}
    pre = PolicyProcessorPipeline(steps=[
        AddBatchDimensionProcessorStep(),
        GrootN17PackInputsStep(action_horizon=arch.chunk_size, valid_action_horizon=arch.chunk_size,
                               max_state_dim=arch.max_state_dim, max_action_dim=arch.max_action_dim, stats=stats),
        GrootN17VLMEncodeStep(model_name=arch.vlm, image_crop_size=[arch.image_crop_size] * 2,
                              image_target_size=[arch.image_target_size] * 2)])
    return policy, pre


def _frames(raw) -> dict:
    return {"observation.images.cam0": raw["images"][:, 0], "observation.state": raw["state"], "task": raw["task"]}


def test_loss_matches_lerobot_groot_policy(tiny, tmp_path):
    """Same weights, batch, noise and flow time: our per-sample losses, weighted by their valid entries, give
    ``GrootPolicy.forward``'s loss (LeRobot's own policy and processor steps)."""
    from loongforge_embodied.policies.lerobot_groot.processor_lerobot_groot import prepare_batch
    from torch.distributions import Beta

    arch, model, raw = tiny
    policy, pre = _lerobot(arch, model, tmp_path / "base")
    policy.train()
    model.train()
    theirs_in = pre({**_frames(raw), "action": raw["actions"], "action_is_pad": raw["action_pad"]})
    b = len(raw["task"])
    # NOTE: the action head draws its noise (randn) then its flow time (Beta(1.5, 1)): replay both under one seed
    torch.manual_seed(7)
    noise = torch.randn(b, arch.chunk_size, arch.max_action_dim)
    s = Beta(torch.tensor(1.5), torch.tensor(1.0), validate_args=False).sample([b])
    torch.manual_seed(7)
    theirs, _ = policy.forward(theirs_in)
    ours_in = prepare_batch({**raw, "noise": noise[..., :2], "time": 1 - (1 - s) * 0.999}, arch=arch, stats=STATS)
    ours_in["noise"] = noise
    for key in ("input_ids", "pixel_values", "state", "actions", "action_mask"):
        expect = theirs_in["action" if key == "actions" else key]
        assert torch.equal(ours_in[key], expect), key
    per_sample = model(ours_in)
    valid = ours_in["action_mask"].sum(dim=(1, 2))
    ours = (per_sample * valid).sum() / valid.sum()
    assert per_sample.shape == (b,)
    ours_f, theirs_f = float(ours.detach()), float(theirs.detach())
    assert abs(ours_f - theirs_f) <= TOL * abs(theirs_f), (ours_f, theirs_f)
    ours.backward()
    assert all(p.grad is not None for p in model._groot_model.action_head.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)


def test_recompute_keeps_loss_and_gradients(tiny):
    """``recompute: full`` (transformers' checkpointing of the backbone + the DiT's own flag) gives the same per-sample
    losses and gradients; only the text model's final norm (unreachable from the loss) is frozen."""
    from loongforge_embodied.policies.lerobot_groot.modeling_lerobot_groot import LeRobotGrootModel
    from loongforge_embodied.policies.lerobot_groot.processor_lerobot_groot import prepare_batch

    arch, model, raw = tiny
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == [
        "_groot_model.backbone.model.model.language_model.norm.weight"]
    g = torch.Generator().manual_seed(4)
    inp = prepare_batch({**raw, "noise": torch.randn(3, arch.chunk_size, 2, generator=g),
                         "time": torch.rand(3, generator=g)}, arch=arch, stats=STATS)
    other = LeRobotGrootModel(arch)
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
    assert grads[0][1].keys() == grads[1][1].keys() and len(grads[0][1]) == len(list(model.parameters())) - 1
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grad, grads[1][1][name], rtol=1e-4, atol=1e-6, msg=name)

def test_export_loads_in_lerobot_and_select_action_matches(tiny, tmp_path):
    """``GrootPolicy.from_pretrained(export)`` (LeRobot's plain loader) + LeRobot's N1.7 steps and post-processor
    return our model's first action under the same sampling noise; our own loader round-trips the export."""
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from lerobot.policies.groot.processor_groot import GrootActionUnpackUnnormalizeStep
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
    from loongforge_embodied.policies.lerobot_groot.export import load_model, write_pretrained
    from loongforge_embodied.policies.lerobot_groot.processor_lerobot_groot import prepare_batch

    arch, model, raw = tiny
    out = write_pretrained(tmp_path / "export", arch=arch, weights=model.state_dict(),
                           features={"cameras": ["observation.images.cam0"]})
    policy = GrootPolicy.from_pretrained(out)
    _, pre = _lerobot(arch, model, tmp_path / "unused")
    stats = {"action": {"min": STATS["action_min"], "max": STATS["action_max"]}}
    post = PolicyProcessorPipeline(steps=[GrootActionUnpackUnnormalizeStep(
        env_action_dim=2, stats=stats, normalize_min_max=True, clip_normalized_action=True)],
        to_transition=policy_action_to_transition, to_output=transition_to_policy_action)
    model.eval()
    obs = {k: v for k, v in raw.items() if k not in ("actions", "action_pad")}
    torch.manual_seed(3)
    ours = model.unnormalize_actions(model.sample_actions(prepare_batch(obs, arch=arch, stats=STATS)))
    torch.manual_seed(3)
    theirs = post(policy.select_action(pre(_frames(raw))))
    assert theirs.shape == (len(raw["task"]), 2)
    torch.testing.assert_close(theirs, ours[:, 0], rtol=TOL, atol=TOL)
    sd = model.state_dict()
    loaded = load_model(out)
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())
    # a GR00T N1.7 model directory as transformers writes it (the published layout: model.load of its weights)
    loaded = load_model(tmp_path / "unused")
    assert loaded.arch == arch.with_overrides(image_size=256, num_cameras=2, state_dim=8, action_dim=8)
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items() if not k.startswith("stats."))


def test_recipe_trains_exports_for_lerobot_and_a_missing_vlm_is_one_line(vlm, tmp_path, monkeypatch, capsys):
    """The tiny recipe trains through the CLI (synthetic frames) and writes an export LeRobot's ``GrootPolicy``
    loads with our weights and ``loongforge serve``'s policy answers the openpi client; the published recipe
    validates; training without the backbone directory is one line
    naming ``model.arch.vlm``."""
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from loongforge.cli import main
    from loongforge.metrics import read_metrics
    from loongforge_embodied.eval.server import PolicyServer
    from loongforge_embodied.eval.trained_policy import TrainedPolicy
    from loongforge_embodied.policies.lerobot_groot.export import load_model
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "embodied" / "lerobot_groot_tiny.yaml"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["validate", str(recipe.with_name("lerobot_groot_pusht.yaml"))]) == 0
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["train", str(recipe), "--output", str(out), f"model.arch.vlm={vlm}", "logging.tensorboard=false"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses)))
    ours = load_model(out / "hf")
    theirs = GrootPolicy.from_pretrained(out / "hf").state_dict()
    assert set(theirs) == {k for k in ours.state_dict() if not k.startswith("stats.")}
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in theirs.items())
    # served: the openpi client gets the chunk of our model for the same request (noise seeded by the request)
    served = TrainedPolicy.load(out)
    features = served.metadata()["features"]
    request = {k: (np.random.default_rng(0).random(f["shape"]) * 255).astype(np.uint8) if len(f["shape"]) == 3
               else np.linspace(-0.5, 0.5, f["shape"][0], dtype=np.float32) for k, f in features.items()}
    request["prompt"] = "push the block"
    with PolicyServer(served, port=0, batch_wait_s=0.0) as server:
        actions = WebsocketClientPolicy(host=server.address).infer(request)["actions"]
    assert actions.shape == (ours.arch.chunk_size, 2) and np.isfinite(actions).all()
    np.testing.assert_allclose(actions, served.infer_batch([request])[0]["actions"], rtol=0, atol=1e-6)
    capsys.readouterr()
    assert main(["train", str(recipe), "--output", str(tmp_path / "bad"), "model.arch.vlm=/nowhere/qwen3vl"]) == 2
    err = capsys.readouterr().err
    assert "key 'model.arch.vlm': '/nowhere/qwen3vl': no local folder" in err and err.count("\n") == 1, err


def test_eval_pusht_records_the_envs_episodes_and_a_missing_extra_is_one_line(tiny, tmp_path, monkeypatch, capsys):
    """``loongforge eval --env pusht`` of a GR00T N1.7 export runs the closed loop on the CPU: each episode's success,
    return and length in ``summary.json`` are what gym-pusht gives for the policy's actions (the episodes rolled out
    again here); without diffusers (``loongforge-embodied[groot]``) it is one line naming the extra."""
    import sys

    from .pusht_closed_loop import check_recorded, eval_pusht, export_for_pusht

    _, model, _ = tiny
    export = export_for_pusht(model, policy="lerobot_groot", out=tmp_path / "hf")
    check_recorded(export, eval_pusht(export, tmp_path / "eval"), policy="lerobot_groot")
    from loongforge.cli import main

    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "diffusers", None)  # NOTE: as if the [groot] extra were not installed
    assert main(["eval", str(export), "--env", "pusht", "--episodes", "1", "--output", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'diffusers'" in err and "loongforge-embodied[groot]" in err, err


@pytest.mark.slow
def test_ddp_and_fsdp2_match_single_process(vlm, tmp_path, env, ranks):
    """2 gloo ranks, ddp and fsdp2 (units: vision blocks, text layers, DiT blocks), in one launch, reproduce the
    one-process losses over 3 steps."""
    from .strategy_losses import one_and_two_ranks

    extra = (f"model.arch.vlm={vlm}",)
    recipe = "lerobot_groot_tiny.yaml"
    single, two = one_and_two_ranks(ranks, tmp_path, env=env, extra=extra, recipe_name=recipe,
                                    strategies=["ddp", "fsdp2"])
    for strategy, losses in two["losses"].items():
        assert losses == pytest.approx(single, rel=TOL), (strategy, losses, single)
