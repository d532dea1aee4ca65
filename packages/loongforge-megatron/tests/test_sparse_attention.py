"""DeepSeek Sparse Attention: the restricted attention and the indexer loss against plain torch, and DeepSeek-V3.2
trained from a checkpoint transformers saved (first-step loss, the dense warm-up and its switch, tp 2 ep 2)."""

from __future__ import annotations

import json
import math

import pytest
import torch

SEQ = 32
TOPK = 8  # < SEQ: the indexer drops keys


def _dense_reference(q, k, v, allowed, scale):
    """Plain softmax attention over ``allowed`` [b, s, s] keys: q, k [s, b, h, dk], v [s, b, h, dv] -> [s, b, h*dv]."""
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    p = scores.masked_fill(~allowed.unsqueeze(1), float("-inf")).softmax(-1)
    out = torch.einsum("bhst,tbhd->sbhd", p, v)
    return out.reshape(out.shape[0], out.shape[1], -1)


def _inputs(seed=0, s=12, b=2, h=3, dk=10, dv=6):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(s, b, h, dk, generator=g), torch.randn(s, b, h, dk, generator=g)
    v = torch.randn(s, b, h, dv, generator=g)
    scores = torch.randn(b, s, s, generator=g).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return q, k, v, scores


@pytest.mark.parametrize("path", ["mask", "kernel_op", "warmup"])
def test_sparse_attention_equals_dense_restricted_to_the_topk(path):
    """Forward and backward: our sparse attention (the exact masked path, and the sparse MLA kernel's contract via
    the registry's torch op) equals dense attention restricted to the same top-k keys; the warm-up's dense path
    equals it over all causal keys."""
    from loongforge.kernels import select_op
    from loongforge_megatron.layers.sparse_attention import (
        kernel_attention,
        restricted_attention,
        select_topk,
        selection_mask,
    )

    q, k, v, scores = _inputs()
    idx, valid = select_topk(scores, 5)
    allowed = selection_mask(idx, valid, q.shape[0])
    assert allowed.sum(-1).tolist()[0][:6] == [1, 2, 3, 4, 5, 5]  # early queries have fewer than topk keys
    scale = 0.3
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if path == "warmup":
        allowed = torch.ones_like(allowed).tril()
        ours = restricted_attention(*leaves, None, scale=scale)
    elif path == "mask":
        ours = restricted_attention(*leaves, allowed, scale=scale)
    else:
        op = select_op("sparse_mla_attention", provider="torch", device_type="cpu")
        ours = kernel_attention(op, *leaves, idx, valid, scale=scale)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _dense_reference(*refs, allowed, scale)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(ref)
    ours.backward(grad)
    ref.backward(grad)
    for a, b in zip(leaves, refs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_warmup", "sparse"])
def test_indexer_loss_equals_plain_torch(sparse):
    """KL(attention distribution summed over heads, L1-normalised || softmax(index scores)), summed over queries;
    over all causal keys in the warm-up, over the selected ones in sparse training."""
    from loongforge_megatron.layers.sparse_attention import indexer_kl_loss, select_topk, selection_mask

    q, k, _, scores = _inputs(seed=1)
    s, b = q.shape[:2]
    causal = torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s)
    idx, valid = select_topk(scores, 4)
    allowed = selection_mask(idx, valid, s) if sparse else causal
    scale = 0.25
    leaf = scores.clone().requires_grad_()
    ours = indexer_kl_loss(leaf, q, k, scale=scale, allowed=allowed)
    total = torch.zeros(())
    for bi in range(b):
        for t in range(s):
            keys = allowed[bi, t].nonzero().flatten().tolist()
            attn = torch.stack([torch.softmax(torch.stack([q[t, bi, h] @ k[j, bi, h] * scale for j in keys]), 0)
                                for h in range(q.shape[2])]).sum(0)
            target = attn / attn.sum()
            log_pred = torch.log_softmax(scores[bi, t, keys], 0)
            total = total + (target * (target.log() - log_pred)).sum()
    assert ours.item() == pytest.approx(total.item(), rel=1e-5)
    ours.backward()
    assert leaf.grad[~allowed].abs().max() == 0 and leaf.grad[allowed].abs().max() > 0


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_warmup", "sparse"])
def test_blockwise_indexer_equals_the_whole_sequence_at_once(sparse):
    """The indexer read a few queries at a time (each block checkpointed) selects the same keys, gives the same
    loss and the same gradients on its weights as the whole sequence's scores at once."""
    from loongforge_megatron.layers.sparse_attention import (
        LightningIndexer,
        index_and_learn,
        indexer_kl_loss,
        select_topk,
        selection_mask,
    )

    torch.manual_seed(3)
    s, b, hidden, rank, rope = 13, 2, 24, 16, 8
    indexer = LightningIndexer(hidden_size=hidden, q_lora_rank=rank, heads=4, head_dim=16, rope_dim=rope,
                               dtype=torch.float32)
    x, qr = torch.randn(s, b, hidden), torch.randn(s, b, rank)
    query, key = torch.randn(s, b, 3, 10), torch.randn(s, b, 3, 10)
    angles = torch.arange(s)[:, None] * torch.linspace(0.1, 1.0, rope)[None, :]
    cos, sin = angles.cos(), angles.sin()
    scale, topk = 0.3, 5

    scores = indexer(x, qr, cos=cos, sin=sin)
    idx_ref, valid_ref = select_topk(scores, topk)
    allowed = (selection_mask(idx_ref, valid_ref, s) if sparse else
               torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s))
    ref = indexer_kl_loss(scores, query, key, scale=scale, allowed=allowed)
    ref_grads = torch.autograd.grad(ref, list(indexer.parameters()))

    idx, valid, loss = index_and_learn(indexer, x, qr, cos=cos, sin=sin, topk=topk, query=query, key=key,
                                       scale=scale, sparse=sparse, block=4)  # NOTE: 13 queries: uneven blocks
    assert torch.equal(idx, idx_ref) and torch.equal(valid, valid_ref)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for ours, theirs in zip(torch.autograd.grad(loss, list(indexer.parameters())), ref_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # selection alone (no loss): the same keys
        idx_only, _, none = index_and_learn(indexer, x, qr, cos=cos, sin=sin, topk=topk, block=6)
    assert none is None and torch.equal(idx_only, idx_ref)


@pytest.mark.parametrize(("args", "key"), [
    (["kernels.layers=te"], "kernels.layers"),
    (["model.dsa.warmup_steps=-1"], "model.dsa.warmup_steps"),
    (["model.dsa.wamrup_steps=3"], "model.dsa"),
    (["model.preset=glm-5-tiny", "model.num_layers=4", "parallel.pp=2", "--world-size", "2"], "parallel.pp"),
])
def test_bad_dsa_settings_are_one_line_errors(capsys, args, key):
    from pathlib import Path

    from loongforge.cli import main

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "llm" / "tiny" / "deepseek_v32_tiny.yaml"
    assert main(["validate", str(recipe), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and key in err, err


# ---- DeepSeek-V3.2 from a transformers-saved checkpoint


@pytest.fixture(scope="module")
def v32_hf(tmp_path_factory):
    """A tiny DeepseekV32ForCausalLM saved by transformers: odd vocab, a dense first layer, a shared expert and 6
    routed experts, an 8-head indexer choosing 8 of 32 keys."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.DeepseekV32Config(vocab_size=509, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6,
                               n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                               topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=TOPK,
                               max_position_embeddings=256, routed_scaling_factor=2.5, rms_norm_eps=1e-6)
    model = tf.DeepseekV32ForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norms, biases and expert biases
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.01 * torch.randn_like(b))
    out = tmp_path_factory.mktemp("v32") / "hf"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def glm5_hf(tmp_path_factory):
    """A tiny GlmMoeDsaForCausalLM (GLM-5): the V3.2 checkpoint's sizes, interleaved-RoPE indexers, and a third
    layer that shares the second one's top-k (no indexer of its own)."""
    import transformers as tf

    torch.manual_seed(1)
    cfg = tf.GlmMoeDsaConfig(vocab_size=509, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6,
                             n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                             topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=TOPK,
                             max_position_embeddings=256, indexer_types=["full", "full", "shared"])
    model = tf.GlmMoeDsaForCausalLM(cfg)
    assert model.model.layers[2].self_attn.indexer is None
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.01 * torch.randn_like(b))
    out = tmp_path_factory.mktemp("glm5") / "hf"
    model.save_pretrained(out)
    return out


def _recipe(tmp_path, hf_dir, *, name, parallel=None, dsa=None, **train):
    import yaml

    r = {
        "backend": "megatron",
        "model": {"hf": str(hf_dir), "dsa": dsa or {}},
        "parallel": parallel or {},
        "data": {"format": "synthetic", "seq_length": SEQ},
        "train": {"stage": "cpt", "steps": 1, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32",
                  "lr": 1e-3, "seed": 7, **train},
        "checkpoint": {"load": str(hf_dir), "save_at_end": False, "save_format": ["hf"]},
        "accelerator": "cpu",
        "logging": {"tensorboard": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def _train(*, rank, world, recipe_path, run_dir, watch=(), export=None, block_elements=None):
    """Step 1's micro-batches, every step's metrics, and snapshots (before, after each step) of the parameters
    whose names contain one of ``watch``; in a rank. ``export``: first write the loaded model there as HF.
    ``block_elements``: the indexer's query blocks that small (several blocks per sequence)."""
    import loongforge
    from loongforge_megatron.layers import sparse_attention

    if block_elements is not None:
        sparse_attention.BLOCK_ELEMENTS = block_elements

    job, _ = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        if export is not None:
            job.export("hf", export)
        named = [(n, p) for c in job.chunks for n, p in c.named_parameters() if any(w in n for w in watch)]
        snaps = [{n: p.detach().clone() for n, p in named}]
        batches = job.schedule.microbatches(0, device=torch.device("cpu"))
        metrics = []
        for _ in range(job.recipe.train.steps):
            metrics.append(job.step())
            snaps.append({n: p.detach().clone() for n, p in named})
    finally:
        job.close()
    return batches, metrics, snaps


@pytest.mark.parametrize("which", ["v32_hf", "glm5_hf"])
def test_first_step_loss_equals_transformers_with_the_indexer_active(tmp_path, which, request, reference_loss, ranks):
    v32_hf = request.getfixturevalue(which)
    recipe = _recipe(tmp_path, v32_hf, name="cpt")
    batches, metrics, _ = ranks(_train, world=1, out=tmp_path / "ranks", recipe_path=recipe,
                                run_dir=tmp_path / "run")[0]
    assert metrics[0]["dsa_sparse"] == 1.0 and metrics[0]["dsa_indexer_loss"] > 0
    ref = reference_loss(v32_hf, batches)
    assert metrics[0]["loss"] == pytest.approx(ref, rel=1e-4), (metrics[0]["loss"], ref)
    # NOTE: the indexer really drops keys here: dense attention gives another loss
    dense = reference_loss(_with(v32_hf, tmp_path / "dense", index_topk=SEQ), batches)
    assert not math.isclose(dense, ref, rel_tol=1e-4)


def _with(hf_dir, out, **cfg):
    import shutil

    shutil.copytree(hf_dir, out)
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, **cfg}))
    return out


def test_dense_warmup_trains_the_indexer_alone_then_switches(tmp_path, v32_hf, ranks):
    """model.dsa.warmup_steps 2: steps 1-2 attend densely and move the indexer only (weight decay on: it does not
    touch the frozen rest either); step 3 is sparse and moves the rest of the model too."""
    recipe = _recipe(tmp_path, v32_hf, name="warm", dsa={"warmup_steps": 2, "loss_weight": 1.0}, steps=3,
                     weight_decay=0.1)
    _, metrics, snaps = ranks(_train, world=1, out=tmp_path / "ranks", recipe_path=recipe, run_dir=tmp_path / "run",
                              watch=("indexer.linear_wq_b", "linear_q_up_proj", "experts.local_experts.0.linear_fc1",
                                     "output_layer"))[0]
    assert [m["dsa_sparse"] for m in metrics] == [0.0, 0.0, 1.0]
    assert all(m["dsa_indexer_loss"] > 0 for m in metrics)
    indexer = [n for n in snaps[0] if "indexer" in n]
    rest = [n for n in snaps[0] if "indexer" not in n]
    assert indexer and rest
    for step in (1, 2):
        assert all(not torch.equal(snaps[step][n], snaps[step - 1][n]) for n in indexer)
        assert all(torch.equal(snaps[step][n], snaps[0][n]) for n in rest), step
    assert all(not torch.equal(snaps[3][n], snaps[2][n]) for n in rest)


@pytest.mark.parametrize(("which", "family"), [("v32_hf", "deepseek_v32"), ("glm5_hf", "glm_moe_dsa")])
def test_hf_roundtrip_tp2_ep2_bit_exact(tmp_path, which, family, request):
    """HF -> megatron (tp 2, ep 2: the indexer replicated on both TP ranks) -> HF, bit-exact."""
    from loongforge.checkpoint import SafetensorsReader
    from loongforge_megatron.conversion import MegatronLayout, hf_to_megatron, megatron_to_hf

    v32_hf = request.getfixturevalue(which)
    layout = hf_to_megatron(v32_hf, tmp_path / "mg", tp=2, pp=1, ep=2)
    assert layout.family == family
    shard = SafetensorsReader(layout.rank_file(tmp_path / "mg", list(layout.ranks())[-1]))
    assert "decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.weight" in shard.keys()
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    a, b = SafetensorsReader(v32_hf), SafetensorsReader(tmp_path / "hf")
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        assert torch.equal(a.get(k), b.get(k)), k
    assert MegatronLayout.load(tmp_path / "mg").family == family


def _even_vocab(hf_dir, out):
    """``hf_dir`` with its vocabulary cut to an even 508 tokens.

    NOTE: under tp 2 an odd vocabulary is padded by one row, whose zero logit joins the softmax of the vocab-
    parallel cross-entropy (about 1/vocab of extra loss, any family): the layout comparison uses an even one."""
    from safetensors.torch import load_file, save_file

    _with(hf_dir, out, vocab_size=508)
    tensors = load_file(out / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:508].contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.slow
def test_tp2_ep2_first_step_equals_transformers(tmp_path, v32_hf, reference_loss, ranks):
    """One gloo launch at tp 2, ep 2 (sequence parallel): the checkpoint loads onto the layout and exports back
    bit-exact, and the first step's loss, sparse, is transformers'."""
    from loongforge.checkpoint import SafetensorsReader

    v32_hf = _even_vocab(v32_hf, tmp_path / "even")
    recipe = _recipe(tmp_path, v32_hf, name="tp2ep2", parallel={"tp": 2, "ep": 2, "sp": True})
    # NOTE: the indexer in blocks of a few queries: the KL target's TP all-reduce runs in each checkpointed block
    out = ranks(_train, world=4, out=tmp_path / "ranks", recipe_path=recipe, run_dir=tmp_path / "run",
                export=tmp_path / "export", block_elements=2048)
    a, b = SafetensorsReader(v32_hf), SafetensorsReader(tmp_path / "export")
    assert sorted(a.keys()) == sorted(b.keys())
    assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    batches, seen = [], set()
    for r in out:  # NOTE: every data-parallel rank's micro-batches once (TP peers hold the same)
        for b in r[0]:
            key = tuple(b["tokens"].flatten().tolist())
            if key not in seen:
                seen.add(key)
                batches.append(b)
    assert len(batches) == 2
    ref = reference_loss(v32_hf, batches)
    assert out[0][1][0]["loss"] == pytest.approx(ref, rel=1e-4)


def test_arch_reads_and_writes_the_indexer_config(v32_hf):
    """config.json -> architecture -> the config an export writes: transformers reads it back with the same indexer
    (and the model type / class that carry it)."""
    import transformers as tf
    from loongforge_megatron.models.hf_arch import arch_from_hf
    from loongforge_megatron.models.registry import hf_config

    arch = arch_from_hf(v32_hf)
    assert (arch.family, arch.dsa_index_heads, arch.dsa_index_head_dim, arch.dsa_index_topk) == ("deepseek_v32", 8, 16,
                                                                                                  TOPK)
    cfg = hf_config(arch)
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"] and cfg["model_type"] == "deepseek_v32"
    back = tf.DeepseekV32Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    src = tf.DeepseekV32Config.from_pretrained(v32_hf)
    for key in ("index_n_heads", "index_head_dim", "index_topk", "q_lora_rank", "n_routed_experts",
                "first_k_dense_replace", "vocab_size"):
        assert getattr(back, key) == getattr(src, key), key


@pytest.mark.slow
def test_cp2_equals_one_process_in_the_warmup_and_the_sparse_phase(tmp_path, v32_hf, ranks):
    """Context parallel 2 (each rank's queries score and attend to the keys gathered over CP) trains 5 steps with
    one process's losses and gradient norms: 2 dense warm-up steps (only the indexer's KL loss back-propagates), then
    3 sparse ones; the CP ranks' indexer losses average to one process's."""
    dsa = {"warmup_steps": 2, "loss_weight": 1.0}
    one = ranks(_train, world=1, out=tmp_path / "one", recipe_path=_recipe(tmp_path, v32_hf, name="one", dsa=dsa,
                                                                           steps=5), run_dir=tmp_path / "run1")[0][1]
    recipe = _recipe(tmp_path, v32_hf, name="cp2", parallel={"cp": 2}, dsa=dsa, steps=5)
    # NOTE: the CP ranks' indexer in blocks of a few queries (the causal mask sliced per block), one process in one
    two = [r[1] for r in ranks(_train, world=2, out=tmp_path / "two", recipe_path=recipe, run_dir=tmp_path / "run2",
                               block_elements=2048)]
    assert [m["dsa_sparse"] for m in one] == [0.0, 0.0, 1.0, 1.0, 1.0]
    for metrics in two:
        assert [m["dsa_sparse"] for m in metrics] == [m["dsa_sparse"] for m in one]
        assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in one], rel=1e-5)
        assert [m["grad_norm"] for m in metrics] == pytest.approx([m["grad_norm"] for m in one], rel=1e-5)
    mean = [sum(r[i]["dsa_indexer_loss"] for r in two) / 2 for i in range(5)]
    # NOTE: over the 8 selected keys the KL is ~1e-4, a difference of nearly equal logs: fp32 reduction order moves
    # it by ~1e-8 absolute (1e-4 relative)
    assert mean == pytest.approx([m["dsa_indexer_loss"] for m in one], rel=1e-5, abs=1e-7)
