"""The hybrid LMs' multi-token-prediction layer as the published checkpoints hold it (``mtp.fc``,
``mtp.pre_fc_norm_embedding`` / ``_hidden``, ``mtp.layers.0`` a full-attention decoder layer, ``mtp.norm``;
transformers ignores it): HF -> megatron (tp 2, pp 2, ep 2) -> HF keeps it bit for bit, and ``loongforge train`` with
``model.mtp_num_layers 1`` loads it: the next-token loss is transformers' and the MTP loss is the one a plain torch
reading of the layer (transformers' own decoder layer, norms and head) gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import loongforge
import pytest
import torch
import yaml


def add_mtp(hf_dir: Path, *, seed: int = 3) -> Path:
    """``hf_dir`` (a tiny Qwen3-Next) with an MTP layer: a full-attention decoder layer of transformers' (its
    parameter names) and the rest, all random; ``mtp_num_hidden_layers`` 1 in config.json."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    config = tf.AutoConfig.from_pretrained(hf_dir)
    full = config.layer_types.index("full_attention")
    torch.manual_seed(seed)
    layer = Qwen3NextDecoderLayer(config, full)
    h = config.hidden_size
    tensors = load_file(hf_dir / "model.safetensors")
    with torch.no_grad():
        for name, p in layer.named_parameters():
            # NOTE: a bare layer is not initialised (transformers inits a whole model): drawn here
            t = (0.1 if p.dim() == 1 else 0.3) * torch.randn(p.shape)
            # NOTE: the published layout has one tensor per expert (transformers' module fuses them)
            if name.endswith("experts.gate_up_proj"):
                for e, (gate, up) in enumerate(x.chunk(2, dim=0) for x in t):
                    tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                    tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = up.contiguous()
            elif name.endswith("experts.down_proj"):
                for e, down in enumerate(t):
                    tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = down.contiguous()
            else:
                tensors[f"mtp.layers.0.{name}"] = t.contiguous()
    tensors.update({"mtp.fc.weight": 0.2 * torch.randn(h, 2 * h), "mtp.norm.weight": 0.1 * torch.randn(h),
                    "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(h),
                    "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(h)})
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}, indent=2))
    return hf_dir


@pytest.fixture(scope="module")
def mtp_dir(hybrid_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_next_mtp") / "hf"
    shutil.copytree(hybrid_hf("qwen3_next"), out)
    return add_mtp(out)


def test_roundtrip_keeps_the_mtp_layer(mtp_dir, tmp_path):
    from loongforge.checkpoint import SafetensorsReader
    from loongforge_megatron.conversion import hf_to_megatron, megatron_to_hf

    layout = hf_to_megatron(mtp_dir, tmp_path / "mg", tp=2, pp=2, ep=2)
    assert layout.mtp_layers == 1
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    a, b = SafetensorsReader(mtp_dir), SafetensorsReader(tmp_path / "hf")
    assert sorted(a.keys()) == sorted(b.keys()) and any(k.startswith("mtp.layers.0.mlp.experts") for k in a.keys())
    for k in a.keys():
        assert torch.equal(a.get(k), b.get(k)), k


def _first_step(*, rank, world, recipe_path, run_dir):
    job, runtime = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        batches = job.schedule.microbatches(0, device=torch.device("cpu"))
        return batches, job.step()
    finally:
        job.close()
        runtime.logger.close()


def mtp_reference_loss(hf_dir: Path, batches: list[dict]) -> float:
    """Depth-1 MTP loss read off the checkpoint with transformers' modules: the final hidden states and the next
    tokens' embeddings, each normed, through ``fc`` (embedding first), the decoder layer (causal, the tokens' own
    positions), ``norm`` and the head predict the token after the next; masked mean per micro-batch, averaged."""
    import transformers as tf
    from safetensors.torch import load_file
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextDecoderLayer,
        Qwen3NextRMSNorm,
        Qwen3NextRotaryEmbedding,
    )

    main = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    cfg = main.config
    cfg._attn_implementation = "eager"
    w = {k[len("mtp."):]: v for k, v in load_file(hf_dir / "model.safetensors").items() if k.startswith("mtp.")}
    layer = Qwen3NextDecoderLayer(cfg, cfg.layer_types.index("full_attention")).eval()
    own = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.") and ".experts." not in k}
    n = cfg.num_experts
    own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w[f"layers.0.mlp.experts.{e}.{p}_proj.weight"]
                                                              for p in ("gate", "up")]) for e in range(n)])
    own["mlp.experts.down_proj"] = torch.stack([w[f"layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(n)])
    layer.load_state_dict(own)
    norm = {n: Qwen3NextRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps) for n in ("norm", "pre_fc_norm_embedding",
                                                                                 "pre_fc_norm_hidden")}
    for n, m in norm.items():
        m.load_state_dict({"weight": w[n + ".weight"]})
    rope = Qwen3NextRotaryEmbedding(cfg)
    losses = []
    with torch.no_grad():
        for b in batches:
            tokens, labels, mask = b["tokens"], b["labels"], b["loss_mask"].float()
            hidden = main.model(input_ids=tokens).last_hidden_state
            emb = main.model.embed_tokens(torch.roll(tokens, -1, dims=-1))
            x = torch.cat([norm["pre_fc_norm_embedding"](emb), norm["pre_fc_norm_hidden"](hidden)], dim=-1)
            x = x @ w["fc.weight"].t()
            s = tokens.shape[1]
            pos = torch.arange(s).expand_as(tokens)
            causal = torch.full((s, s), float("-inf")).triu(1).expand(tokens.shape[0], 1, s, s)
            x = layer(x, position_embeddings=rope(x, pos), attention_mask=causal, position_ids=pos)
            x = x[0] if isinstance(x, tuple) else x
            logits = main.lm_head(norm["norm"](x)).float()
            target, m = torch.roll(labels, -1, dims=-1), torch.roll(mask, -1, dims=-1)
            m[:, -1] = 0
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
            losses.append(float((ce * m.flatten()).sum() / m.sum()))
    return sum(losses) / len(losses)


def test_mtp_layer_trains_from_the_checkpoint(mtp_dir, tmp_path, reference_loss, ranks):
    r = {"backend": "megatron", "model": {"hf": str(mtp_dir), "mtp_num_layers": 1, "mtp_loss_weight": 0.3},
         "data": {"format": "synthetic", "seq_length": 24},
         "train": {"stage": "cpt", "steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "precision": "fp32",
                   "lr": 1e-3, "seed": 7},
         "checkpoint": {"load": str(mtp_dir), "save_at_end": False}, "accelerator": "cpu",
         "logging": {"tensorboard": False}}
    path = tmp_path / "cpt.yaml"
    path.write_text(yaml.safe_dump(r))
    batches, metrics = ranks(_first_step, world=1, out=tmp_path / "ranks", recipe_path=path,
                             run_dir=tmp_path / "run")[0]
    assert metrics["loss"] == pytest.approx(reference_loss(mtp_dir, batches), rel=1e-4)
    assert metrics["mtp_loss"] == pytest.approx(mtp_reference_loss(mtp_dir, batches), rel=1e-4)
