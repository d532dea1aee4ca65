"""LeRobot's own PI05 (``PI05Pytorch``) through our trainer, on a shrunken model on the CPU (fp32).

Parity: our per-sample loss equals ``PI05Policy.forward(batch, reduction="none")`` on the same weights, batch,
noise and time to 1e-5, with our SDPA joint layer and with LeRobot's eager one (observed: ~1e-7); gradients of
the two attention paths agree to 1e-5. Also: the adaptation is checked / reversible / leaves LeRobot's own
policy alone, the processor reproduces LeRobot's normalisation and prompt, training reduces the loss, the
recipe trains through the CLI and its export loads with ``PI05Policy.from_pretrained``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
TOL = 1e-5


# NOTE: these tests examine the adaptation door itself, from outside any applied set
_OUTSIDE_THE_ADAPTATIONS = {"test_adaptation_is_checked_and_reversible", "test_async_masks_adaptation_keeps_torch_for_lerobot"}


@pytest.fixture(autouse=True)
def _pi05_adapted(request):
    """The policy's adaptations, as a job applies them for its run (the model refuses to run without them)."""
    if request.node.originalname in _OUTSIDE_THE_ADAPTATIONS:
        yield
        return
    from loongforge_embodied.policies.lerobot_pi05 import attention

    with attention.adapted():
        yield


@pytest.fixture(scope="module")
def tiny():
    from loongforge_embodied.policies.lerobot_pi05.configuration_lerobot_pi05 import PRESETS
    from loongforge_embodied.policies.lerobot_pi05.modeling_lerobot_pi05 import LeRobotPI05Model
    from loongforge_embodied.policies.lerobot_pi05.processor_lerobot_pi05 import prepare_batch

    arch = PRESETS["tiny"]
    torch.manual_seed(0)
    model = LeRobotPI05Model(arch)
    g = torch.Generator().manual_seed(1)
    b = 3
    # NOTE: 24x28 frames exercise LeRobot's resize-with-pad; tasks of different lengths exercise padding.
    raw = {"images": torch.rand(b, 1, 3, 24, 28, generator=g), "state": torch.randn(b, 2, generator=g),
           "actions": torch.randn(b, arch.chunk_size, 2, generator=g),
           "noise": torch.randn(b, arch.chunk_size, 2, generator=g), "time": torch.rand(b, generator=g) * 0.9 + 0.05,
           "task": ["push it", "a much longer task description than the others", "x"]}
    stats = {"state_mean": torch.tensor([0.1, -0.2]), "state_std": torch.tensor([1.5, 0.7]),
             "action_mean": torch.tensor([0.3, 0.0]), "action_std": torch.tensor([2.0, 0.5])}
    return arch, model, raw, stats, prepare_batch(raw, arch=arch, stats=stats)


def _set_attention(model, mode: str) -> None:
    from loongforge_embodied.policies.lerobot_pi05.attention import MODE

    for layer in model._prefix_layers():
        setattr(layer, MODE, mode)


def _lerobot_policy(arch, model):
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from loongforge_embodied.policies.lerobot_pi05.build import pi05_config, shrunk_sizes

    with shrunk_sizes(arch):
        policy = PI05Policy(pi05_config(arch))
    policy.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("stats.")}, strict=True)
    return policy


def test_loss_matches_lerobot_policy_forward(tiny):
    from loongforge_embodied.policies.lerobot_pi05 import attention

    arch, model, raw, stats, inp = tiny
    policy = _lerobot_policy(arch, model)
    policy.model.sample_noise = lambda shape, device: inp["noise"]
    policy.model.sample_time = lambda bsize, device: inp["time"]
    batch = {"observation.images.cam0": raw["images"][:, 0], "observation.state": raw["state"],
             "action": (raw["actions"] - stats["action_mean"]) / stats["action_std"],
             "observation.language.tokens": inp["lang_tokens"],
             "observation.language.attention_mask": inp["lang_mask"]}
    calls = []
    twin = attention.sdpa_layer_complete
    attention.sdpa_layer_complete = lambda *a, **k: calls.append(1) or twin(*a, **k)
    try:
        ref, _ = policy.forward(batch, reduction="none")
        assert not calls, "LeRobot's own policy must keep its eager joint layer"
        with torch.no_grad():
            _set_attention(model, "sdpa")
            ours = model(inp)
            assert len(calls) == arch.lm_depth
            _set_attention(model, "eager")
            eager = model(inp)
    finally:
        attention.sdpa_layer_complete = twin
        _set_attention(model, "sdpa")
    torch.testing.assert_close(ours, ref.detach(), rtol=0, atol=TOL)
    torch.testing.assert_close(eager, ref.detach(), rtol=0, atol=TOL)
    assert inp["lang_mask"].sum(1).unique().numel() == 3  # the three prompts are padded differently


@pytest.mark.parametrize("twin", ["sdpa_layer_complete", "matmul_layer_complete"])
def test_sdpa_gradients_match_eager(tiny, twin, monkeypatch):
    """Our twin's gradients equal LeRobot's eager joint layer's, with SDPA (eager units) and with the GEMM +
    masked-softmax attention compiled units run (the three prompts are padded differently: the key mask)."""
    from loongforge_embodied.policies.lerobot_pi05 import attention

    _, model, _, _, inp = tiny
    monkeypatch.setattr(attention, "sdpa_layer_complete", getattr(attention, twin))

    def grads(mode):
        _set_attention(model, mode)
        model.zero_grad(set_to_none=True)
        model(inp).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    try:
        sdpa, eager = grads("sdpa"), grads("eager")
    finally:
        _set_attention(model, "sdpa")
        model.zero_grad(set_to_none=True)
    assert sdpa.keys() == eager.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for name in sdpa:
        torch.testing.assert_close(sdpa[name], eager[name], rtol=0, atol=TOL, msg=name)


def test_adaptation_is_checked_and_reversible(tiny, monkeypatch):
    from lerobot.policies.pi05 import modeling_pi05
    from loongforge.accelerator.adaptation import active
    from loongforge.errors import AdaptationError
    from loongforge_embodied.policies.lerobot_pi05 import attention

    original = modeling_pi05.compute_layer_complete
    assert attention.NAME not in active() and not hasattr(original, "__wrapped__")
    with attention.adapted(), attention.adapted():  # a nested set shares the applied one
        assert modeling_pi05.compute_layer_complete.__wrapped__ is original
        assert attention.NAME in active()
    assert modeling_pi05.compute_layer_complete is original and attention.NAME not in active()
    with pytest.raises(RuntimeError, match="adapted"):  # the model does not silently run LeRobot's eager step
        tiny[1](tiny[4])
    monkeypatch.setattr(modeling_pi05, "compute_layer_complete", lambda *a, **k: None)  # "an upgraded LeRobot"
    with pytest.raises(AdaptationError, match="pi05-joint-layer"):
        attention.adapted().__enter__()
    assert attention.NAME not in active()


def test_siglip_fused_qkv_is_transformers_attention(tiny):
    """Our model's SigLIP attention runs q/k/v as one GEMM: outputs and gradients equal transformers' own
    forward on the same module (fp32), and LeRobot's own policy is left with transformers' forward."""
    from loongforge_embodied.policies import siglip_names
    from loongforge_embodied.policies.lerobot_pi05.attention import _fused_qkv_forward
    from transformers.models.siglip.modeling_siglip import SiglipAttention

    arch, model, *_ = tiny
    attn = siglip_names.encoder_layers(model.model.paligemma_with_expert.paligemma.model.vision_tower)[0].self_attn
    assert attn.forward.__func__ is _fused_qkv_forward
    x = torch.randn(2, 7, attn.embed_dim, generator=torch.Generator().manual_seed(3), requires_grad=True)
    results = []
    for forward in (attn.forward, functools.partial(SiglipAttention.forward, attn)):
        attn.zero_grad(set_to_none=True)
        x.grad = None
        out = forward(x)[0]
        out.square().sum().backward()
        results.append((out.detach(), x.grad.clone(), [p.grad.clone() for p in attn.parameters()]))
    (o1, gx1, gp1), (o2, gx2, gp2) = results
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx2, rtol=1e-5, atol=1e-6)
    for a, b in zip(gp1, gp2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    attn.zero_grad(set_to_none=True)
    calls = []
    handle = attn.k_proj.register_forward_hook(lambda *a: calls.append(1))  # e.g. an adapter: runs as itself
    try:
        torch.testing.assert_close(attn.forward(x)[0], o1, rtol=1e-5, atol=1e-6)
    finally:
        handle.remove()
    assert calls == [1]
    policy = _lerobot_policy(arch, model)
    other = siglip_names.encoder_layers(policy.model.paligemma_with_expert.paligemma.model.vision_tower)[0]
    assert "forward" not in other.self_attn.__dict__


def test_token_table_gradient_is_row_sparse(tiny):
    """``row_sparse_rows`` names every row the token table's gradient can be nonzero in (``KernelAdamW`` skips
    the others): after a backward, the rows with a gradient are a subset of the batch's prompt tokens."""
    _, model, _, _, batch = tiny
    (table,) = model.row_sparse_params()
    assert table is model.model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight
    assert table not in {p for p in model._unused_in_training()}  # NOTE: not tied to the frozen lm_head
    model.zero_grad(set_to_none=True)
    model(batch).sum().backward()
    try:
        touched = set(table.grad.abs().amax(dim=1).nonzero().flatten().tolist())
        ((param, rows),) = model.row_sparse_rows(batch)
        assert param is table and touched and touched <= set(rows.flatten().tolist())
    finally:
        model.zero_grad(set_to_none=True)


def test_async_masks_adaptation_keeps_torch_for_lerobot(tiny):
    """``modeling_pi05.torch`` is a pass-through whose ``tensor()`` only changes how CUDA tensors are copied
    (pinned, non-blocking); everything else, and CPU results, are torch's own. Leaving the set restores torch."""
    from lerobot.policies.pi05 import modeling_pi05
    from loongforge_embodied.policies.lerobot_pi05 import attention

    with attention.adapted():
        proxy = modeling_pi05.torch
        assert isinstance(proxy, attention._TorchWithAsyncTensor)
        assert proxy.cat is torch.cat and proxy.bool is torch.bool
        for data, kw in (([0, 1, 1], {"dtype": torch.bool, "device": "cpu"}), ([1.5, 2.0], {"dtype": torch.bfloat16}),
                         (3, {})):
            got, want = proxy.tensor(data, **kw), torch.tensor(data, **kw)
            assert torch.equal(got, want) and got.dtype == want.dtype and got.device == want.device
    assert modeling_pi05.torch is torch
    with attention.adapted():
        assert isinstance(modeling_pi05.torch, attention._TorchWithAsyncTensor)


def test_processor_follows_lerobot(tiny):
    from loongforge_embodied.policies.lerobot_pi05.processor_lerobot_pi05 import (
        BYTE_OFFSET,
        pad_noise,
        prepare_batch,
    )

    arch, _, raw, stats, inp = tiny
    ids = inp["lang_tokens"][0][inp["lang_mask"][0]]
    assert ids[0] == 2  # <bos>
    text = bytes((ids[1:] - BYTE_OFFSET).tolist()).decode()
    state = (raw["state"][0] - stats["state_mean"]) / stats["state_std"]
    bins = torch.bucketize(state, torch.linspace(-1, 1, 257)[:-1], right=True) - 1
    assert text == f"Task: push it, State: {bins[0]} {bins[1]};\nAction: "
    assert inp["images"].shape[-2:] == (arch.resolution, arch.resolution) and inp["images"].min() >= -1
    assert inp["actions"].shape[-1] == arch.max_action_dim and not inp["actions"][..., 2:].any()
    torch.testing.assert_close(inp["noise"][..., :2], raw["noise"])
    assert inp["noise"][..., 2:].std() > 0.5  # padded dims are noise too, as in LeRobot
    torch.testing.assert_close(pad_noise(raw["noise"][1:2], 32), inp["noise"][1:2])  # per sample, any batch
    q = {"state_q01": torch.tensor([-2.0, 0.0]), "state_q99": torch.tensor([2.0, 4.0]),
         "action_q01": torch.tensor([-1.0, -1.0]), "action_q99": torch.tensor([3.0, 1.0])}
    out = prepare_batch(raw, arch=arch.with_overrides(quantile_norm=1), stats=q)
    expect = 2 * (raw["actions"] - q["action_q01"]) / (q["action_q99"] - q["action_q01"]) - 1
    torch.testing.assert_close(out["actions"][..., :2], expect)
    with pytest.raises(ValueError, match="quantile_norm"):
        prepare_batch(raw, arch=arch.with_overrides(quantile_norm=1), stats=stats)


def test_prompt_padding_longest_keeps_the_losses_and_grads(tiny):
    """Padding a batch to its longest prompt (rounded up) instead of ``tokenizer_max_length`` changes no loss or
    gradient: padded keys are masked and positions count valid tokens only."""
    from loongforge_embodied.policies.lerobot_pi05.processor_lerobot_pi05 import prepare_batch

    arch, model, raw, stats, _ = tiny
    raw = {**raw, "task": ["push it", "x", "go left"]}

    def run(padding):
        inp = prepare_batch(raw, arch=arch.with_overrides(prompt_padding=padding), stats=stats)
        model.zero_grad(set_to_none=True)
        loss = model(inp)
        loss.sum().backward()
        return inp["lang_tokens"].shape[1], loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                            if p.grad is not None}

    for mode in ("sdpa", "eager"):  # our SDPA twin and LeRobot's own joint layer
        try:
            _set_attention(model, mode)
            (w_long, l_long, g_long), (w_max, l_max, g_max) = run("longest"), run("max_length")
        finally:
            _set_attention(model, "sdpa")
            model.zero_grad(set_to_none=True)
        assert w_max == arch.tokenizer_max_length == 96
        assert w_long % arch.prompt_pad_multiple == 0 and w_long < w_max  # "x": 28 bytes + <bos> -> 32
        torch.testing.assert_close(l_long, l_max, rtol=0, atol=TOL)
        assert g_long.keys() == g_max.keys()
        for name in g_long:
            torch.testing.assert_close(g_long[name], g_max[name], rtol=0, atol=TOL, msg=f"{mode}: {name}")
    with pytest.raises(ValueError, match="prompt_padding 'dynamic'"):
        arch.with_overrides(prompt_padding="dynamic")


def test_hugging_face_tokenizer_as_lerobot_calls_it(tmp_path):
    from loongforge_embodied.policies.lerobot_pi05.processor_lerobot_pi05 import encode_prompts
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "Task:", "push", "it,", "State:", "1", "2", "3", ";", "Action:"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                 unk_token="<unk>")
    hf.save_pretrained(tmp_path / "tok")
    prompts = ["Task: push it, State: 12 3;\nAction: ", "Task: push it, State: 3;\nAction: "]
    ref = hf(prompts, max_length=12, truncation=True, padding="max_length", padding_side="right", return_tensors="pt")
    ids, mask = encode_prompts(prompts, max_length=12, tokenizer=str(tmp_path / "tok"))
    torch.testing.assert_close(ids, ref["input_ids"])
    torch.testing.assert_close(mask, ref["attention_mask"].bool())
    assert ids[0, 0] == 2 and mask[0].sum() == 10  # <bos> Task: push it, State: 1 2 3 ; Action:
    short, short_mask = encode_prompts(prompts, max_length=12, padding="longest", multiple=4,
                                       tokenizer=str(tmp_path / "tok"))
    assert short.shape == (2, 12) and torch.equal(short, ids)  # 10 rounds up to 12
    short, short_mask = encode_prompts(prompts, max_length=64, padding="longest", multiple=8,
                                       tokenizer=str(tmp_path / "tok"))
    assert short.shape == (2, 16) and torch.equal(short[:, :10], ids[:, :10]) and not short_mask[:, 10:].any()
    from loongforge.errors import RecipeError

    with pytest.raises(RecipeError, match="key 'model.arch.tokenizer': '.*nowhere' does not load"):
        encode_prompts(prompts, max_length=12, tokenizer=str(tmp_path / "nowhere"))


def test_training_steps_reduce_the_loss(tiny):
    from loongforge_embodied.policies.lerobot_pi05.modeling_lerobot_pi05 import LeRobotPI05Model

    arch, _, _, _, inp = tiny
    torch.manual_seed(0)
    model = LeRobotPI05Model(arch)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=True)
    losses = []
    for _ in range(6):
        loss = model(inp).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_real_size_is_lerobots_pi05():
    """gemma_2b + gemma_300m + So400m on the meta device: 4.14B parameters, LeRobot's bf16/fp32 split."""
    from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch
    from loongforge_embodied.policies.lerobot_pi05.build import pi05_config
    from loongforge_embodied.policies.lerobot_pi05.configuration_lerobot_pi05 import PRESETS

    with torch.device("meta"):
        model = PI05Pytorch(pi05_config(PRESETS["pi05"]))
    by_dtype: dict[torch.dtype, int] = {}
    for p in model.parameters():
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    assert round(sum(by_dtype.values()) / 1e9, 2) == 4.14
    assert by_dtype[torch.float32] < by_dtype[torch.bfloat16]


def test_recipe_trains_through_cli_and_exports_for_lerobot(tiny, tmp_path, monkeypatch):
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from loongforge.cli import main
    from loongforge.metrics import read_metrics
    from loongforge_embodied.policies.lerobot_pi05.build import shrunk_sizes
    from loongforge_embodied.policies.lerobot_pi05.export import arch_from_dir, load_model
    from safetensors import safe_open

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["train", str(ROOT / "recipes" / "embodied" / "lerobot_pi05_tiny.yaml"), "--output", str(out),
                     "train.steps=4", "logging.tensorboard=false"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 4]
    hf = out / "hf"
    assert json.loads((hf / "config.json").read_text())["type"] == "pi05"
    assert json.loads((hf / "loongforge.json").read_text())["stats"]["action_std"] == [1.0, 1.0]
    # SigLIP is written in the layout of transformers < 5.6 (LeRobot's pin), whatever transformers is installed
    with safe_open(hf / "model.safetensors", "pt") as f:
        assert any(".vision_tower.vision_model." in k for k in f.keys())
    with shrunk_sizes(arch_from_dir(hf)):
        policy = PI05Policy.from_pretrained(hf, strict=True)
    ours = load_model(hf).state_dict()
    theirs = policy.state_dict()
    assert set(theirs) == {k for k in ours if not k.startswith("stats.")}
    for key, value in theirs.items():
        assert torch.equal(value, ours[key]), key
    # ... and our trainer starts from it (``model.load``: our export or a LeRobot pi05 checkpoint dir).
    torch.set_num_threads(1)
    try:
        code = main(["train", str(ROOT / "recipes" / "embodied" / "lerobot_pi05_tiny.yaml"), "--output",
                     str(tmp_path / "again"), "train.steps=2", f"model.load={hf}", "logging.tensorboard=false",
                     "checkpoint.save_format=[dist]"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    first = {r["step"]: r["loss"] for r in read_metrics(out)}[1]
    assert {r["step"]: r["loss"] for r in read_metrics(tmp_path / "again")}[1] < first  # the trained weights


@pytest.mark.slow
def test_ddp_and_fsdp2_match_single_process(tmp_path, env, ranks):
    """2 gloo ranks, ddp and fsdp2 (units: vision layers + each prefix / expert layer, entered by the joint
    step) reproduce the one-process losses (observed: identical)."""
    from .strategy_losses import run_strategies

    # NOTE: the timeouts are the deadlock watchdog (a hung collective fails with every rank's stack)
    single = ranks(run_strategies, world=1, out=tmp_path / "one", env=env, timeout_s=600,
                   recipe_name="lerobot_pi05_tiny.yaml", steps=3, strategies=["ddp"])[0]["losses"]["ddp"]
    two = ranks(run_strategies, world=2, out=tmp_path / "two", env=env, timeout_s=600,
                recipe_name="lerobot_pi05_tiny.yaml", steps=3, strategies=["ddp", "fsdp2"])[0]
    for strategy, losses in two["losses"].items():
        assert losses == pytest.approx(single, rel=TOL), (strategy, losses, single)


def test_sampling_matches_lerobot_predict_action_chunk(tiny):
    """Inference: our ``sample_actions`` (SDPA joint layer, KV-cached prefix) gives LeRobot's
    ``PI05Policy.predict_action_chunk`` on the same weights, frames, prompt and noise seed."""
    arch, model, raw, _, inp = tiny
    policy = _lerobot_policy(arch, model)
    batch = {"observation.images.cam0": raw["images"][:, 0], "observation.state": raw["state"],
             "observation.language.tokens": inp["lang_tokens"],
             "observation.language.attention_mask": inp["lang_mask"]}
    torch.manual_seed(7)
    theirs = policy.predict_action_chunk(batch)
    torch.manual_seed(7)
    ours = model.eval().sample_actions(inp)
    model.train()
    assert ours.shape == theirs.shape == (3, arch.chunk_size, arch.action_dim)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_load_accepts_either_siglip_layout(tiny, tmp_path):
    """Exports carry SigLIP in the layout of transformers < 5.6 (LeRobot's pin: under ``vision_model.``); a
    checkpoint in either layout loads into the installed one (5.24 here: flat)."""
    from loongforge_embodied.policies import siglip_names
    from loongforge_embodied.policies.lerobot_pi05.export import LM_HEAD, load_model, write_pretrained
    from safetensors.torch import load_file, save_file

    arch, model, *_ = tiny
    out = write_pretrained(tmp_path / "hf", arch=arch, weights=model.state_dict(), features={"cameras": ["cam0"]})
    nested = load_file(str(out / "model.safetensors"))
    assert siglip_names.is_nested(nested) and not siglip_names.is_nested(model.state_dict())
    assert siglip_names.roots(nested) == {"model.paligemma_with_expert.paligemma.model.vision_tower."}
    for layout in (nested, siglip_names.to_layout(nested, nested=False)):
        save_file(layout, str(out / "model.safetensors"))
        loaded = load_model(out).state_dict()
        for k, v in model.state_dict().items():
            if not k.startswith("stats.") and k != LM_HEAD:  # the export writes the (trained) token table there
                assert torch.equal(loaded[k], v), k


def test_matmul_attention_equals_sdpa_and_never_nans():
    """The compiled units' attention (GEMMs around a masked fp32 softmax) equals SDPA's on rows with a valid key,
    averages a row with none (LeRobot's finite mask) instead of giving NaN, and hands long key sequences to SDPA."""
    from loongforge_embodied.policies.lerobot_pi05 import attention

    g = torch.Generator().manual_seed(0)
    for keys in (12, attention.MATMUL_MAX_KEYS + 1):
        q = torch.randn(3, 5, 4, 8, generator=g, requires_grad=True)
        k, v = (torch.randn(3, keys, 1, 8, generator=g, requires_grad=True) for _ in range(2))
        valid = torch.ones(3, keys, dtype=torch.bool)
        valid[1, keys // 2:] = False
        valid[2] = False  # no valid key at all
        ours = attention._attend_matmul(q, k, v, valid, 0.3)
        ours.square().sum().backward()
        assert all(torch.isfinite(t).all() for t in (ours, q.grad, k.grad, v.grad))
        ref = attention._attend(q, k, v, valid, 0.3)
        torch.testing.assert_close(ours[:2], ref[:2], rtol=1e-5, atol=1e-6)
        if keys <= attention.MATMUL_MAX_KEYS:  # the average of the values, as LeRobot's eager softmax gives
            torch.testing.assert_close(ours[2], v[2, :, 0].mean(0).repeat(4).expand(5, -1), rtol=1e-5, atol=1e-6)


def test_compiled_units_give_the_eager_losses(tmp_path, monkeypatch):
    """``train.compile`` (each FSDP2 unit torch.compiled, the joint layers' GEMM + softmax body included) trains the same
    numbers as eager on the CPU (fp32; inductor's fused kernels reorder sums, so 1e-5 relative)."""
    from loongforge.api import build_job, load_recipe
    from loongforge_embodied.policies.lerobot_pi05 import attention

    bodies = []
    compiled_body = attention._compiled
    monkeypatch.setattr(attention, "_compiled", lambda body, mode: bodies.append(body) or compiled_body(body, mode))

    def losses(compile: bool) -> list[float]:
        over = ["train.steps=3", "train.global_batch_size=2", "train.micro_batch_size=2", "checkpoint.resume=never",
                "checkpoint.save_at_end=false", "logging.console=false", "logging.tensorboard=false",
                f"train.compile={str(compile).lower()}"]
        job, _ = build_job(load_recipe(ROOT / "recipes/embodied/lerobot_pi05_tiny.yaml", over),
                           output_dir=tmp_path / str(compile))
        try:
            if compile:
                units = job.model.raw.wrap_units()
                assert all(u._compiled_call_impl is not None for u in units)
            out = [job.step(report=True)["loss"] for _ in range(3)]
            if compile:
                assert compiled_body.cache_info().currsize >= 1  # the joint layers ran their compiled body
                assert set(bodies) == {attention.matmul_layer_complete}  # the GEMM + softmax twin
            return out
        finally:
            job.close()

    eager, compiled = losses(False), losses(True)
    assert compiled == pytest.approx(eager, rel=1e-5), (eager, compiled)


def test_compile_mode_needs_compile(capsys):
    """``compile_mode`` without ``compile`` is refused; CUDA graphs (reduce-overhead) are accepted on one process
    and under ddp / zero1 on several, with or without gradient accumulation, and refused under fsdp2 / hsdp."""
    from loongforge.cli import main

    tiny = str(ROOT / "recipes/embodied/lerobot_pi05_tiny.yaml")
    assert main(["validate", tiny, "train.compile_mode=reduce-overhead"]) == 2
    assert "compile_mode" in capsys.readouterr().err
    graphs = ["train.compile=true", "train.compile_mode=reduce-overhead"]
    assert main(["validate", tiny, *graphs]) == 0  # global 4 / micro 2: two micro-batches a step
    for strategy in ("auto", "ddp", "zero1"):
        assert main(["validate", tiny, *graphs, f"parallel.strategy={strategy}", "--world-size", "2"]) == 0
    assert main(["validate", tiny, *graphs, "parallel.strategy=fsdp2", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "key 'train.compile_mode'" in err and "'fsdp2' on 2 processes" in err and err.count("\n") == 1, err
    # max-autotune replays CUDA graphs too; its -no-cudagraphs variant does not
    assert main(["validate", tiny, "train.compile=true", "train.compile_mode=max-autotune", "parallel.strategy=hsdp",
                 "parallel.shard_size=1", "--world-size", "2"]) == 2
    assert "compile_mode max-autotune (CUDA graphs)" in capsys.readouterr().err
    assert main(["validate", tiny, "train.compile=true", "train.compile_mode=max-autotune-no-cudagraphs",
                 "parallel.strategy=fsdp2", "--world-size", "2"]) == 0
    assert main(["validate", tiny, "train.compile=true", "train.compile_mode=max-autotune-no-cudagraphs"]) == 0


def test_export_note_says_how_lerobot_loads_a_shrunken_model():
    """LeRobot's own ``from_pretrained`` builds only the real sizes: a tiny export says how to load it."""
    import dataclasses

    from loongforge_embodied.policies.lerobot_pi05.configuration_lerobot_pi05 import PRESETS
    from loongforge_embodied.policies.lerobot_pi05.export import LEROBOT_TOKENIZER, serving_note

    tiny = serving_note(PRESETS["tiny"])
    assert "smaller than LeRobot's pi05" in tiny and "shrunk_sizes(arch_from_dir(DIR))" in tiny
    assert serving_note(dataclasses.replace(PRESETS["pi05"], tokenizer=LEROBOT_TOKENIZER)) == ""


def test_real_size_export_loads_into_lerobots_own_policy():
    """At LeRobot's real size (meta device, no weights): every tensor the export writes goes through LeRobot's own
    loading path (its key fixes, the ``model.`` prefix, ``load_state_dict``) with no missing / unexpected key and no
    size mismatch. Values are compared tensor by tensor at tiny size (``test_recipe_trains_through_cli...``)."""
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from loongforge_embodied.policies import siglip_names
    from loongforge_embodied.policies.lerobot_pi05.build import pi05_config
    from loongforge_embodied.policies.lerobot_pi05.configuration_lerobot_pi05 import PRESETS
    from loongforge_embodied.policies.lerobot_pi05.export import EMBED, LM_HEAD, STATS_PREFIX
    from loongforge_embodied.policies.lerobot_pi05.modeling_lerobot_pi05 import LeRobotPI05Model

    arch = PRESETS["pi05"]
    config = pi05_config(arch)
    config.device = "meta"  # NOTE: PI05Policy moves its model to config.device
    with torch.device("meta"):
        ours = LeRobotPI05Model(arch)
        policy = PI05Policy(config)
    # what write_pretrained writes (its layout steps, on meta tensors)
    written = siglip_names.to_layout({k: v for k, v in ours.state_dict().items() if not k.startswith(STATS_PREFIX)},
                                     nested=True)
    written[LM_HEAD] = written[EMBED]
    assert siglip_names.is_nested(written)
    fixed = policy._fix_pytorch_state_dict_keys(written, policy.config)
    remapped = {k if k.startswith("model.") else f"model.{k}": v for k, v in fixed.items()}
    result = policy.load_state_dict(remapped, strict=False, assign=True)  # NOTE: a size mismatch raises here
    assert not result.missing_keys and not result.unexpected_keys, (result.missing_keys[:5], result.unexpected_keys[:5])
    assert sum(v.numel() for v in policy.state_dict().values()) > 4e9
