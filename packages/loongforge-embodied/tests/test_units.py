"""Pure-logic checks: the sampler's step → samples mapping, the LR schedule, recipe rejections."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongforge.errors import LoongForgeError, RecipeError
from loongforge.recipe import load_recipe
from loongforge_embodied.backend import EmbodiedBackend
from loongforge_embodied.data.sampler import GlobalBatchSampler
from loongforge_embodied.optim import lr_at

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"


def _flat(sampler: GlobalBatchSampler, step: int) -> list[tuple[int, int]]:
    return [x for mb in sampler.step_microbatches(step) for x in mb]


def test_sampler_split_does_not_change_the_step():
    kw = dict(num_samples=10, global_batch=8, seed=3)
    one = GlobalBatchSampler(micro_batch=2, dp_rank=0, dp_size=1, **kw)
    two = [GlobalBatchSampler(micro_batch=2, dp_rank=r, dp_size=2, **kw) for r in range(2)]
    for step in range(4):  # crosses epoch boundaries (10 samples, 8 per step)
        assert _flat(one, step) == _flat(two[0], step) + _flat(two[1], step)
    epoch0 = sorted(one.index(p) for p in range(10))
    assert epoch0 == list(range(10))


def test_sampler_resumes_at_step():
    kw = dict(num_samples=7, global_batch=4, micro_batch=2, dp_rank=0, dp_size=1, seed=0)
    it = iter(GlobalBatchSampler(**kw))
    stream = [next(it) for _ in range(10)]
    resumed = iter(GlobalBatchSampler(start_step=3, **kw))
    assert [next(resumed) for _ in range(4)] == stream[6:10]


def test_lr_schedule():
    t = load_recipe(RECIPE, ["train.lr=1.0", "train.min_lr=0.1", "train.warmup_steps=2", "train.steps=12"]).train
    assert lr_at(0, t) == pytest.approx(0.5) and lr_at(1, t) == pytest.approx(1.0)
    assert lr_at(2, t) == pytest.approx(1.0) and lr_at(12, t) == pytest.approx(0.1)


@pytest.mark.parametrize(("override", "key"), [
    ("parallel.tp=2", "parallel.tp"),
    ("train.precision=fp16", "train.precision"),
    ("parallel.shard_size=1", "parallel.shard_size"),
    ("train.stage=lora", "train.stage"),
    ("parallel.recompute=selective", "parallel.recompute"),
    ("parallel.components={vision: {tp: 1}}", "parallel.components"),
])
def test_recipe_rejections_name_the_key(override, key):
    with pytest.raises(RecipeError) as err:
        EmbodiedBackend().validate(load_recipe(RECIPE, [override]), world_size=2)
    assert err.value.key == key


def test_hsdp_needs_shard_size_and_divisibility():
    with pytest.raises(RecipeError, match="shard_size"):
        EmbodiedBackend().validate(load_recipe(RECIPE, ["parallel.strategy=hsdp"]), world_size=2)
    with pytest.raises(LoongForgeError, match="shard_size"):
        EmbodiedBackend().validate(load_recipe(RECIPE, ["parallel.strategy=hsdp", "parallel.shard_size=3"]),
                                   world_size=2)


def test_unknown_arch_field_is_a_recipe_error():
    with pytest.raises(LoongForgeError, match="unknown architecture fields"):
        load_recipe(RECIPE, ["model.arch={lm_hiden: 32}"])


def test_arch_values_are_checked_at_load_time(tmp_path, monkeypatch):
    """Wrong-typed arch overrides and a tokenizer that is not on this machine fail when the recipe loads (naming
    the field), not in a DataLoader worker."""
    pi05 = RECIPE.parent / "lerobot_pi05_tiny.yaml"
    with pytest.raises(RecipeError, match="'lm_width' must be an integer"):
        load_recipe(pi05, ["model.arch.lm_width=wide"])
    with pytest.raises(RecipeError, match="prompt_padding 'dynamic'"):
        load_recipe(pi05, ["model.arch.prompt_padding=dynamic"])
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_id = "google/paligemma-3b-pt-224"
    with pytest.raises(RecipeError, match=f"model.arch.tokenizer '{hub_id}'.*no tokenizer.json or tokenizer.model"):
        load_recipe(pi05, [f"model.arch.tokenizer={hub_id}"])
    with pytest.raises(RecipeError, match="the folder has neither tokenizer.json nor tokenizer.model"):
        load_recipe(pi05, [f"model.arch.tokenizer={tmp_path}"])
    repo = tmp_path / "hub/models--google--paligemma-3b-pt-224"
    (repo / "snapshots/abc").mkdir(parents=True)
    with pytest.raises(RecipeError, match="no tokenizer.json"):  # a snapshot folder without the files
        load_recipe(pi05, [f"model.arch.tokenizer={hub_id}"])
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text("abc")
    (repo / "snapshots/abc/tokenizer.json").write_text("{}")
    assert load_recipe(pi05, [f"model.arch.tokenizer={hub_id}"]).model.arch["tokenizer"] == hub_id


def test_fsdp2_upcasts_mixed_dtype_weights(tmp_path):
    """A policy that keeps some trainable weights in bf16 and others in fp32 (LeRobot's PI05 "bfloat16") shards
    under fsdp2 with fp32 master weights instead of failing in FSDP's uniform-dtype assertion."""
    import torch
    import torch.distributed as dist
    from loongforge_embodied.parallel import parallelize
    from torch import nn

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4).to(torch.bfloat16)
            self.b = nn.Linear(4, 2)  # fp32, like LeRobot's norms / vision tower

        def wrap_units(self):
            return [self.a, self.b]

        def forward(self, x):
            return self.b(self.a(x.to(self.a.weight.dtype)).float())  # follows its weights, as LeRobot does

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = Mixed()
        par = parallelize(model, strategy="fsdp2", world_size=1, device=torch.device("cpu"), precision="fp32")
        assert par.notes == ["fsdp2: trainable weights were bfloat16, float32; sharded master weights are float32"]
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        par.module(torch.randn(3, 4)).sum().backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_siglip_names_nest_and_flatten_every_tower():
    from loongforge_embodied.policies import siglip_names

    flat = {"model.vision.embeddings.patch_embedding.weight": 1, "model.vision.encoder.layers.0.mlp.fc1.weight": 2,
            "model.vision.post_layernorm.weight": 3, "model.vision_proj.weight": 4,  # not part of the tower
            "model.b.vision.tower.embeddings.patch_embedding.weight": 5, "model.b.vision.tower.head.probe": 6}
    nested = siglip_names.to_layout(flat, nested=True)
    assert nested == {"model.vision.vision_model.embeddings.patch_embedding.weight": 1,
                      "model.vision.vision_model.encoder.layers.0.mlp.fc1.weight": 2,
                      "model.vision.vision_model.post_layernorm.weight": 3, "model.vision_proj.weight": 4,
                      "model.b.vision.tower.vision_model.embeddings.patch_embedding.weight": 5,
                      "model.b.vision.tower.vision_model.head.probe": 6}
    assert siglip_names.roots(nested) == siglip_names.roots(flat) == {"model.vision.", "model.b.vision.tower."}
    assert siglip_names.is_nested(nested) and not siglip_names.is_nested(flat)
    assert siglip_names.to_layout(nested, nested=False) == flat
    assert siglip_names.match(nested, flat.keys()) == flat and siglip_names.match(flat, nested) == nested


def test_unreported_steps_do_the_same_work_without_reading_the_loss(tmp_path):
    """``step(report=False)`` is the same optimizer step without the host sync; ``run()`` reads the loss only on
    the steps it logs (and before saves), and the logged losses equal a step-by-step run's."""
    import json

    from loongforge.api import build_job, load_recipe

    over = ["train.steps=5", "checkpoint.resume=never", "checkpoint.save_at_end=false", "logging.console=false",
            "logging.tensorboard=false", "logging.interval=2", "checkpoint.save_interval=3"]
    job, _ = build_job(load_recipe(RECIPE, over), output_dir=tmp_path / "a")
    try:
        reference = [job.step()["loss"] for _ in range(5)]
    finally:
        job.close()
    job, _ = build_job(load_recipe(RECIPE, over), output_dir=tmp_path / "b")
    try:
        assert job.step(report=False) == {} and job.step(report=False) == {}
        third = job.step()
        assert third["loss"] == reference[2] and third["step_time"] > 0
    finally:
        job.close()
    job, runtime = build_job(load_recipe(RECIPE, over), output_dir=tmp_path / "c")
    try:
        last = job.run()
    finally:
        job.close()
        runtime.logger.close()
    run_dir = runtime.output_dir
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 4, 5]
    assert [r["loss"] for r in logged] == [reference[i - 1] for i in (1, 2, 4, 5)]
    assert last["step"] == 5 and last["loss"] == reference[4]
    assert (runtime.checkpoint_dir / "step_00000003").is_dir()


def test_resume_into_another_models_run_is_a_clear_error(tmp_path):
    """A run directory whose checkpoint holds another policy, or other shapes, is refused in one line (DCP's own
    CheckpointException is a BaseException that would end in a traceback)."""
    from loongforge.api import build_job, load_recipe

    over = ["train.steps=3", "checkpoint.save_at_end=true", "logging.console=false", "logging.tensorboard=false"]
    job, _ = build_job(load_recipe(RECIPE, over), output_dir=tmp_path)
    try:
        job.run()
    finally:
        job.close()
    groot = RECIPE.with_name("tiny_groot_synthetic.yaml")
    with pytest.raises(LoongForgeError, match="holds a 'tiny_vla' policy, this recipe builds 'groot'"):
        build_job(load_recipe(groot, over), output_dir=tmp_path)
    with pytest.raises(LoongForgeError, match="does not match this recipe's model .*Size mismatch"):
        build_job(load_recipe(RECIPE, [*over, "model.arch={lm_hidden: 48}"]), output_dir=tmp_path)


def test_missing_lerobot_dataset_is_refused_at_validation(tmp_path):
    """A ``lerobot`` data root that does not exist (and nothing to record) fails validation naming data.root,
    instead of LeRobot trying the hub at train time."""
    with pytest.raises(RecipeError, match="'/nonexistent' does not exist") as info:
        load_recipe(RECIPE, ["data.format=lerobot", "data.root=/nonexistent"])
    assert info.value.key == "data.root"
    with pytest.raises(RecipeError, match="is not a LeRobotDataset"):
        load_recipe(RECIPE, ["data.format=lerobot", f"data.root={tmp_path}"])


@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipped / not clipped
def test_clip_through_fused_adamw_equals_scaling_the_grads(max_norm):
    """The clip handed to fused AdamW (``grad_scale``) updates as scaling the gradients first does, in bf16 and
    fp32 parameters alike, and leaves the clipped gradients behind; other optimizers are not targets."""
    import torch
    from loongforge_embodied.optim import fused_scale_target
    from loongforge_embodied.parallel import clip_grad_norm

    g = torch.Generator().manual_seed(0)
    init = [torch.randn(64, 32, generator=g), torch.randn(32, generator=g).bfloat16()]
    grads = [torch.randn(64, 32, generator=g), torch.randn(32, generator=g).bfloat16()]

    def run(fused_clip: bool):
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=True)
        for _ in range(2):
            for p, gr in zip(params, grads, strict=True):
                p.grad = gr.clone()
            target = fused_scale_target(opt) if fused_clip else None
            norm = clip_grad_norm(params, max_norm, into=target)
            opt.step()
        return params, norm, opt

    (fused, n1, opt), (plain, n2, _) = run(True), run(False)
    assert fused_scale_target(opt) is opt
    torch.testing.assert_close(n1, n2)
    # NOTE: bf16 within an ulp or two: the fused path divides in fp32 inside the kernel, while scaling first
    # rounds the clipped gradient to bf16 before the update.
    for a, b in zip(fused, plain, strict=True):
        tol = {"rtol": 1e-6, "atol": 1e-6} if a.dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
        torch.testing.assert_close(a, b, **tol)
        torch.testing.assert_close(a.grad, b.grad, **tol)
    if max_norm < 1:
        assert float(n1) > max_norm  # the clip did act
    # all-bf16 gradients (a bf16 norm): the scale handed over is still fp32, as the fused kernel requires
    only_bf16 = [torch.nn.Parameter(init[1].clone())]
    only_bf16[0].grad = grads[1].clone()
    opt16 = torch.optim.AdamW(only_bf16, lr=0.1, fused=True)
    clip_grad_norm(only_bf16, 0.05, into=opt16)
    assert opt16.grad_scale.dtype == torch.float32 and float(opt16.grad_scale) > 1
    opt16.step()
    clip_grad_norm(only_bf16, 0.0, into=opt16)  # clipping off: nothing stale is left for the next step
    assert opt16.grad_scale is None
    foreach = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=True)
    assert fused_scale_target(foreach) is None and fused_scale_target(torch.optim.SGD(fused[:1], lr=0.1)) is None


def test_ema_follows_the_weights_and_is_exported_and_resumed(tmp_path):
    """``train.ema_decay``: after each optimizer step every trainable weight's EMA moves by ``1 - decay`` towards
    it (one foreach lerp); the export writes the EMA weights and a resume restores the EMA exactly."""
    import torch
    from loongforge.api import build_job, load_recipe
    from loongforge_embodied.checkpoint import full_state_dict

    over = ["train.steps=3", "train.ema_decay=0.5", "checkpoint.save_at_end=false", "logging.console=false",
            "logging.tensorboard=false", "checkpoint.save_interval=2"]
    job, _ = build_job(load_recipe(RECIPE, over), output_dir=tmp_path)
    try:
        raw = job.model.raw
        expected = {n: p.detach().float().clone() for n, p in raw.named_parameters() if p.requires_grad}
        assert expected.keys() == job.ema.keys() and len(expected) > 10
        for step in range(3):
            job.step(report=False)
            for n, p in raw.named_parameters():
                if n in expected:
                    expected[n].lerp_(p.detach().float(), 0.5)
            assert all(torch.equal(job.ema[n], e) for n, e in expected.items()), step
            if step == 1:
                job.save()
                at_save = {n: e.clone() for n, e in expected.items()}
        exported = full_state_dict(job.model.raw, ema=job.ema)
        weights = dict(raw.named_parameters())
        assert all(torch.equal(exported[n], e) for n, e in expected.items())
        assert any(not torch.equal(exported[n], weights[n].detach()) for n in expected)
    finally:
        job.close()
    job, _ = build_job(load_recipe(RECIPE, [*over, "checkpoint.resume=auto"]), output_dir=tmp_path)
    try:
        assert job.step_index == 2
        assert all(torch.equal(job.ema[n], e) for n, e in at_save.items())
    finally:
        job.close()


def test_ema_of_bf16_weights_is_kept_in_fp32(monkeypatch):
    """Averages are fp32 whatever the weights' dtype: from 0.5 towards bf16 weights of 1.0 with decay 0.999, each
    step moves 5e-4, under half a bf16 step at 0.5 (2e-3), so a bf16 average would never move. Lower-precision
    weights are upcast a chunk at a time, with the same result."""
    import torch
    from loongforge_embodied import optim

    weights = [torch.ones(300, dtype=torch.bfloat16), torch.ones(200, dtype=torch.bfloat16), torch.ones(50)]
    whole = [torch.full((w.numel(),), 0.5) for w in weights]
    chunked = [e.clone() for e in whole]
    for _ in range(100):
        optim.update_ema(list(zip(whole, weights, strict=True)), 0.999)
    monkeypatch.setattr(optim, "EMA_UPCAST_CHUNK", 100)
    for _ in range(100):
        optim.update_ema(list(zip(chunked, weights, strict=True)), 0.999)
    expected = 1 - 0.5 * 0.999**100
    for e, c in zip(whole, chunked, strict=True):
        assert e.dtype == torch.float32 and torch.allclose(e, torch.full_like(e, expected), rtol=1e-5)
        assert torch.equal(e, c)


def test_noise_injected_recording_labels_the_clean_expert_action(tmp_path):
    """data.record.noise (DART): the executed actions are perturbed, so the states leave the clean recording's,
    while the labels of the first plan (made from the same reset state) stay the expert's clean actions."""
    import numpy as np
    import pyarrow.parquet as pq
    from loongforge_embodied.data.record import record_pusht

    got = {}
    for noise in (0.0, 20.0):
        root = record_pusht(tmp_path / f"n{noise:g}", repo_id="local/x", episodes=1, max_steps=6, image_size=16,
                            seed=0, noise=noise)
        t = pq.read_table(sorted(root.glob("data/*/*.parquet")), columns=["action", "observation.state"])
        got[noise] = (np.array(t.column("action").to_pylist()), np.array(t.column("observation.state").to_pylist()))
    (a0, s0), (a1, s1) = got[0.0], got[20.0]
    assert a0.shape == a1.shape == (6, 2) and np.array_equal(s0[0], s1[0])
    assert np.array_equal(a0[:3], a1[:3])  # the approach's first waypoints: one plan from the reset state
    assert not np.allclose(s0[2:], s1[2:])  # the noisy execution moved the pusher elsewhere


def test_recorded_and_served_state_with_velocity_is_the_pose_then_the_pushers_velocity(tmp_path):
    """observation.environment_state_with_velocity = the pose (observation.environment_state) + the pusher's
    velocity at that frame, recorded and served alike: at rest at reset, moving once the expert walks, and the
    same numbers the eval adapter gives when the recorded actions are replayed from the recorded seed."""
    import numpy as np
    import pyarrow.parquet as pq
    from loongforge_embodied.data.record import record_pusht
    from loongforge_embodied.eval.envs.pusht import PushTAdapter

    root = record_pusht(tmp_path / "d", repo_id="local/x", episodes=1, max_steps=5, image_size=16, seed=3)
    keys = ["action", "observation.environment_state", "observation.environment_state_with_velocity"]
    t = pq.read_table(sorted(root.glob("data/*/*.parquet")), columns=keys)
    action, pose, with_v = (np.array(t.column(k).to_pylist(), np.float32) for k in keys)
    assert with_v.shape == (5, 7) and np.array_equal(with_v[:, :5], pose)
    assert np.array_equal(with_v[0, 5:], [0.0, 0.0]) and (np.linalg.norm(with_v[1:, 5:], axis=1) > 1.0).all()
    env = PushTAdapter(image_size=None)
    served = [env.reset(seed=3)["observation.environment_state_with_velocity"]]
    served += [env.step(a).observation["observation.environment_state_with_velocity"] for a in action[:-1]]
    env.close()
    np.testing.assert_allclose(np.stack(served), with_v, rtol=0, atol=1e-3)


def test_recording_refuses_to_replace_a_folder_that_is_not_a_dataset(tmp_path):
    """``data.record`` replaces ``data.root``: a non-empty folder without ``meta/info.json`` (a parent folder, a
    typo) or a file is refused, naming the key, and nothing is deleted (it used to be ``rmtree``'d up front)."""
    from loongforge_embodied.data.record import record_pusht

    pusht = RECIPE.with_name("tiny_vla_pusht.yaml")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for root, what in ((mine, "non-empty folder that is not a LeRobotDataset"), (mine / "notes.txt", "is a file")):
        with pytest.raises(RecipeError, match=what) as e:
            EmbodiedBackend.check_recipe(load_recipe(pusht, [f"data.root={root}"]))
        assert e.value.key == "data.root"
        with pytest.raises(RecipeError, match=what):
            record_pusht(root, repo_id="local/x", episodes=1, max_steps=2, image_size=16, seed=0)
    assert (mine / "notes.txt").read_text() == "keep me"
    EmbodiedBackend.check_recipe(load_recipe(pusht, [f"data.root={tmp_path / 'new'}"]))
    (tmp_path / "empty").mkdir()
    EmbodiedBackend.check_recipe(load_recipe(pusht, [f"data.root={tmp_path / 'empty'}"]))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_resumes_exactly_with_and_without_momentum(tmp_path, momentum):
    """SGD keeps no optimizer state without momentum: a resume must not expect a momentum buffer (it used to fail
    with "Missing key in checkpoint state_dict: optim.<name>.momentum_buffer")."""
    from loongforge.api import build_job

    over = ["train.steps=3", "train.optimizer=sgd", f"train.adam_beta1={momentum}", "train.lr=0.01",
            "checkpoint.save_interval=2", "checkpoint.save_at_end=false", "logging.console=false",
            "logging.tensorboard=false"]
    job, _ = build_job(load_recipe(RECIPE, [*over, "checkpoint.resume=never"]), output_dir=tmp_path / "straight")
    try:
        straight = [job.step()["loss"] for _ in range(3)]
    finally:
        job.close()
    job, _ = build_job(load_recipe(RECIPE, over), output_dir=tmp_path / "resumed")
    try:
        job.step()
        job.step()
        job.save()
    finally:
        job.close()
    job, _ = build_job(load_recipe(RECIPE, over), output_dir=tmp_path / "resumed")
    try:
        assert job.step_index == 2
        assert job.step()["loss"] == straight[2]
    finally:
        job.close()


def test_save_format_hf_writes_the_export_and_no_resume_checkpoint(tmp_path):
    """``checkpoint.save_format: [hf]`` asks for the export only (as on the megatron backend): no DCP checkpoint
    at ``save_interval`` or at the end (pi05's would be tens of GB of weights and AdamW state)."""
    from loongforge.api import build_job

    over = ["train.steps=3", "checkpoint.save_interval=2", "checkpoint.save_format=[hf]", "logging.console=false",
            "logging.tensorboard=false"]
    job, runtime = build_job(load_recipe(RECIPE, over), output_dir=tmp_path)
    try:
        assert job.run()["step"] == 3
    finally:
        job.close()
    assert not any(runtime.checkpoint_dir.glob("step_*"))
    assert (runtime.hf_dir / "model.safetensors").is_file()
    # NOTE: the export starts another run (model.load); one of other sizes is a one-line error naming the key
    again = ["train.steps=3", "logging.console=false", "logging.tensorboard=false", f"model.load={runtime.hf_dir}"]
    job, _ = build_job(load_recipe(RECIPE, again), output_dir=tmp_path / "again")
    job.close()
    with pytest.raises(RecipeError, match="does not fit this recipe's model .*size mismatch") as e:
        build_job(load_recipe(RECIPE, [*again, "model.arch={lm_hidden: 48}"]), output_dir=tmp_path / "other")
    assert e.value.key == "model.load"


def _fake_dataset(root: Path, *, state: int = 2, action: int = 2, cameras: tuple[str, ...] = ("observation.image",)):
    """Just the ``meta/info.json`` the recipe check reads (no frames)."""
    import json

    feats = {"observation.state": {"dtype": "float32", "shape": [state]}, "action": {"dtype": "float32", "shape": [action]}}
    feats.update({c: {"dtype": "image", "shape": [16, 16, 3]} for c in cameras})
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "info.json").write_text(json.dumps({"features": feats}))
    return root


def test_dataset_and_policy_mismatches_are_one_line_errors_at_recipe_check(tmp_path):
    """A camera name the dataset lacks, or state / action dims over the policy's limits, are found when the recipe is
    checked (they used to be a DataLoader worker's KeyError at the first batch, or a ValueError traceback at setup)."""
    data = _fake_dataset(tmp_path / "ds", action=7, cameras=("observation.images.top", "observation.images.wrist"))
    pusht = RECIPE.with_name("tiny_vla_pusht.yaml")
    with pytest.raises(RecipeError, match=r"'observation.images.tpo' not among the cameras .*allowed: "
                                          r"observation.images.top, observation.images.wrist") as e:
        EmbodiedBackend.check_recipe(load_recipe(pusht, [f"data.root={data}", "data.cameras=[observation.images.tpo]"]))
    assert e.value.key == "data.cameras"
    EmbodiedBackend.check_recipe(load_recipe(pusht, [f"data.root={data}", "data.cameras=[observation.images.top]"]))
    groot = RECIPE.with_name("tiny_groot_pusht.yaml")
    with pytest.raises(RecipeError, match=r"max_action_dim 4.*action_dim 7") as e:
        EmbodiedBackend.check_recipe(load_recipe(groot, [f"data.root={data}"]))
    assert e.value.key == "model.arch"
    EmbodiedBackend.check_recipe(load_recipe(groot, [f"data.root={data}", "model.arch={max_action_dim: 8}"]))


def test_pi05_quantile_normalisation_without_quantile_statistics_is_a_setup_error(tmp_path):
    """``quantile_norm: 1`` on statistics without q01/q99 (synthetic frames) is refused at job setup, naming the key,
    instead of a ValueError inside the first batch's collate."""
    from loongforge.api import build_job

    pi05 = RECIPE.with_name("lerobot_pi05_tiny.yaml")
    with pytest.raises(RecipeError, match=r"needs \['state_q01', 'state_q99'\]") as e:
        build_job(load_recipe(pi05, ["model.arch.quantile_norm=1", "logging.console=false",
                                     "logging.tensorboard=false"]), output_dir=tmp_path)
    assert e.value.key == "model.arch.quantile_norm"
