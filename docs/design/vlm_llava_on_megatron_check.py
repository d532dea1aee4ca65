"""Feasibility spike: megatron-core LLaVAModel (local specs, CPU, fp32, TP=PP=1) vs HF LlavaForConditionalGeneration.

Run:  cd /work/main && OMP_NUM_THREADS=1 uv run python docs/design/vlm_llava_on_megatron_check.py            # TP=1 comparison (~30 s)
      cd /work/main && OMP_NUM_THREADS=1 uv run python docs/design/vlm_llava_on_megatron_check.py --checks   # quirk evidence, controls
      cd /work/main && OMP_NUM_THREADS=1 uv run python docs/design/vlm_llava_on_megatron_check.py --tp2      # TP=2, 2 forked gloo ranks
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

torch.set_num_threads(1)

# --------------------------------------------------------------------------------------------- sizes
V_HID, V_FFN, V_LAYERS, V_HEADS, IMG, PATCH = 32, 64, 3, 4, 32, 8
T_VOCAB, T_HID, T_FFN, T_LAYERS, T_HEADS, T_KV = 256, 64, 128, 2, 4, 2
IMAGE_TOKEN = 255
IMG_SEQ = (IMG // PATCH) ** 2  # 16 patch embeddings per image (class token dropped)
VISION_FEATURE_LAYER = -2
MEGATRON_VISION_LAYERS = V_LAYERS + 1 + VISION_FEATURE_LAYER  # hidden_states[-2] = output of layer L-2 -> L-1 layers


# --------------------------------------------------------------------------------------------- HF side
def build_hf():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vcfg = CLIPVisionConfig(
        hidden_size=V_HID,
        intermediate_size=V_FFN,
        num_hidden_layers=V_LAYERS,
        num_attention_heads=V_HEADS,
        image_size=IMG,
        patch_size=PATCH,
        hidden_act="quick_gelu",
    )
    tcfg = LlamaConfig(
        vocab_size=T_VOCAB,
        hidden_size=T_HID,
        intermediate_size=T_FFN,
        num_hidden_layers=T_LAYERS,
        num_attention_heads=T_HEADS,
        num_key_value_heads=T_KV,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    cfg = LlavaConfig(
        vision_config=vcfg,
        text_config=tcfg,
        image_token_index=IMAGE_TOKEN,
        projector_hidden_act="gelu",
        vision_feature_layer=VISION_FEATURE_LAYER,
        vision_feature_select_strategy="default",
        image_seq_length=IMG_SEQ,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).float().eval()
    # Random init of HF leaves norms at 1/0 and some biases at 0: perturb everything so that a wrong mapping shows.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layer_norm" in name or "layrnorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()
    return model


# --------------------------------------------------------------------------------------------- batch
def make_batch():
    """HF batch (expanded: IMG_SEQ image ids per image; labels unshifted, -100 on prompt + image)
    and the megatron batch derived from it (one image id per image; labels shifted left like GPT)."""
    g = torch.Generator().manual_seed(2)

    def txt(n):
        return torch.randint(2, IMAGE_TOKEN, (n,), generator=g).tolist()

    # (prompt-before-image, prompt-after-image, answer): the same compact length for both samples
    layouts = [(3, 2, 5), (1, 4, 5)]
    hf_ids, hf_labels, mg_ids, mg_labels = [], [], [], []
    for pre, post, ans in layouts:
        bos = [1]
        p1, p2, a = txt(pre - 1 if pre > 1 else 0), txt(post), txt(ans)
        compact = bos + p1 + [IMAGE_TOKEN] + p2 + a
        expanded = bos + p1 + [IMAGE_TOKEN] * IMG_SEQ + p2 + a
        lab = [-100] * (len(expanded) - ans) + a  # loss on the answer only
        hf_ids.append(expanded)
        hf_labels.append(lab)
        # megatron: labels[j] = target predicted at compact position j = HF label at the expanded position
        # after the LAST expanded position of compact token j (for the image token: the first text after it)
        last_pos, e = [], 0
        for tok in compact:
            e += IMG_SEQ if tok == IMAGE_TOKEN else 1
            last_pos.append(e - 1)
        ml = [lab[p + 1] if p + 1 < len(lab) else -100 for p in last_pos]
        mg_ids.append(compact)
        mg_labels.append(ml)
    hf = {
        "input_ids": torch.tensor(hf_ids),
        "labels": torch.tensor(hf_labels),
        "pixel_values": torch.randn(2, 3, IMG, IMG, generator=g),
    }
    mg_ids_t = torch.tensor(mg_ids)
    mg_labels_t = torch.tensor(mg_labels)
    mg = {
        "images": hf["pixel_values"],
        "input_ids": mg_ids_t,
        "position_ids": torch.arange(mg_ids_t.shape[1]).expand_as(mg_ids_t),
        "labels": mg_labels_t,
        "loss_mask": (mg_labels_t != -100).float(),
    }
    return hf, mg


# --------------------------------------------------------------------------------------------- megatron side
@contextlib.contextmanager
def megatron_world(tp=1):
    from loongforge.accelerator.cpu import CpuAccelerator
    from loongforge.parallel.plan import resolve_plan
    from loongforge_megatron import engine
    from loongforge_megatron.device_adapters import adapted

    acc = CpuAccelerator()
    with adapted(acc):
        engine.initialize(resolve_plan(world_size=tp, tp=tp), accelerator=acc, seed=1234)
        try:
            yield
        finally:
            engine.destroy(process_group=True)


@contextlib.contextmanager
def llava_cpu_patches(skip=()):
    """Extra, scoped patches that LLaVAModel needs on a CPU-only host without TE/Apex (see FINDINGS.md).

    1. CLIPViTModel's default ln_pre_impl is torch.nn.LayerNorm when TE is missing, but it is built with
       build_module(..., config=..., hidden_size=..., eps=...) -> TypeError. LLaVAModel gives no way to pass
       ln_pre_impl, so the name CLIPViTModel in llava_model is replaced by a partial with WrappedTorchNorm.
    2. CLIPViTModel.__init__ does `torch.arange(seq).expand(1, -1).cuda()` -> Tensor.cuda() is an identity on
       CPU tensors while the model is built (the project's cuda_copy_as_identity helper).
    3. LLaVAModel.forward calls torch.cuda.current_device() when sound_clips is None -> llava_model's `torch`
       is the project's CpuTorch proxy (same trick the CPU adapters use for other megatron modules).
    """
    from loongforge_megatron.device_adapters.cpu_torch import CpuTorch, cuda_copy_as_identity
    from megatron.core.models.multimodal import llava_model as lm
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    orig_clip, orig_torch = lm.CLIPViTModel, lm.torch
    if "ln_pre" not in skip:
        lm.CLIPViTModel = functools.partial(
            CLIPViTModel, ln_pre_impl=WrappedTorchNorm, ln_post_impl=WrappedTorchNorm
        )
    if "cuda_device" not in skip:
        lm.torch = CpuTorch()
    try:
        with cuda_copy_as_identity() if "cuda_copy" not in skip else contextlib.nullcontext():
            yield
    finally:
        lm.CLIPViTModel, lm.torch = orig_clip, orig_torch


def megatron_configs(hf_cfg, tp=1):
    from megatron.core.activations import quick_gelu
    from megatron.core.transformer import TransformerConfig

    common = dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
    )
    vc, tc = hf_cfg.vision_config, hf_cfg.text_config
    rope_theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", getattr(tc, "rope_theta", 10000.0))

    language = TransformerConfig(
        num_layers=tc.num_hidden_layers,
        hidden_size=tc.hidden_size,
        ffn_hidden_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_query_groups=tc.num_key_value_heads,
        kv_channels=tc.hidden_size // tc.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=tc.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        **common,
    )
    vision = TransformerConfig(
        num_layers=MEGATRON_VISION_LAYERS,
        hidden_size=vc.hidden_size,
        ffn_hidden_size=vc.intermediate_size,
        num_attention_heads=vc.num_attention_heads,
        kv_channels=vc.hidden_size // vc.num_attention_heads,
        normalization="LayerNorm",
        layernorm_epsilon=vc.layer_norm_eps,
        add_bias_linear=True,
        add_qkv_bias=True,
        gated_linear_unit=False,
        activation_func=quick_gelu,
        **common,
    )
    vision.vision_model_type = "clip"  # read by LLaVAModel; not a TransformerConfig field
    projection = TransformerConfig(
        num_layers=1,  # unused by MLP, required by TransformerConfig
        hidden_size=tc.hidden_size,  # projector output size = language hidden
        ffn_hidden_size=tc.hidden_size,  # linear_1 output size (HF: text hidden)
        num_attention_heads=tc.num_attention_heads,  # unused by MLP; must be divisible by TP
        add_bias_linear=True,  # HF multimodal_projector_bias=True
        gated_linear_unit=False,
        activation_func=F.gelu,  # HF projector_hidden_act="gelu" (erf)
        **common,
    )
    return language, vision, projection, rope_theta


def build_megatron(hf_cfg, tp=1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    language, vision, projection, rope_theta = megatron_configs(hf_cfg, tp)
    model = LLaVAModel(
        language_transformer_config=language,
        language_transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        language_vocab_size=T_VOCAB,
        language_max_sequence_length=128,
        vision_transformer_config=vision,
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=True,
        vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        vision_projection_type="mlp",
        parallel_output=True,  # False + labels at TP>1 = loss + ln(TP): CE over gathered logits treated as a vocab shard
        share_embeddings_and_output_weights=False,
        language_position_embedding_type="rope",
        language_rotary_percent=1.0,
        language_rotary_base=int(rope_theta),
        img_h=IMG,
        img_w=IMG,
        patch_dim=PATCH,
        image_token_index=IMAGE_TOKEN,
    )
    return model.float().eval(), (language, vision, projection, rope_theta)


# --------------------------------------------------------------------------------------------- mapping
NAIVE_QKV = False  # negative control (--checks): plain [q; k; v] concatenation, no per-group interleave
SWAP_GATE_UP = False  # negative control (--checks): [up; gate] instead of [gate; up]


def fuse_qkv(q, k, v, num_heads, num_groups):
    """HF separate q/k/v ([nh*d, ...], [ng*d, ...]) -> megatron linear_qkv, per query group [q_g..., k_g, v_g]."""
    if NAIVE_QKV:
        return torch.cat([q, k, v], dim=0)
    d = q.shape[0] // num_heads
    rest = q.shape[1:]
    q = q.reshape(num_groups, (num_heads // num_groups) * d, *rest)
    k = k.reshape(num_groups, d, *rest)
    v = v.reshape(num_groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def hf_to_megatron(hf_sd, hf_cfg):
    """Returns (megatron state dict, list of HF keys deliberately not used)."""
    out = {}
    used = set()

    def take(k):
        used.add(k)
        return hf_sd[k]

    vp = "model.vision_tower."  # transformers 5: vision_tower is CLIPVisionTransformer-like (no .vision_model.)
    vc = hf_cfg.vision_config
    # --- vision embeddings
    out["vision_model.conv1.weight"] = take(vp + "embeddings.patch_embedding.weight")
    out["vision_model.class_token"] = take(vp + "embeddings.class_embedding").reshape(1, 1, -1)
    out["vision_model.position_embeddings.weight"] = take(vp + "embeddings.position_embedding.weight")
    out["vision_model.ln_pre.weight"] = take(vp + "pre_layrnorm.weight")
    out["vision_model.ln_pre.bias"] = take(vp + "pre_layrnorm.bias")
    # --- vision layers (only the first MEGATRON_VISION_LAYERS: vision_feature_layer=-2)
    for i in range(MEGATRON_VISION_LAYERS):
        h, m = f"{vp}encoder.layers.{i}.", f"vision_model.decoder.layers.{i}."
        for wb in ("weight", "bias"):
            out[m + f"input_layernorm.{wb}"] = take(h + f"layer_norm1.{wb}")
            out[m + f"self_attention.linear_qkv.{wb}"] = fuse_qkv(
                take(h + f"self_attn.q_proj.{wb}"),
                take(h + f"self_attn.k_proj.{wb}"),
                take(h + f"self_attn.v_proj.{wb}"),
                vc.num_attention_heads,
                vc.num_attention_heads,  # MHA: one group per head
            )
            out[m + f"self_attention.linear_proj.{wb}"] = take(h + f"self_attn.out_proj.{wb}")
            out[m + f"pre_mlp_layernorm.{wb}"] = take(h + f"layer_norm2.{wb}")
            out[m + f"mlp.linear_fc1.{wb}"] = take(h + f"mlp.fc1.{wb}")
            out[m + f"mlp.linear_fc2.{wb}"] = take(h + f"mlp.fc2.{wb}")
    # --- projector
    for hf_n, mg_n in (("linear_1", "linear_fc1"), ("linear_2", "linear_fc2")):
        for wb in ("weight", "bias"):
            out[f"vision_projection.encoder.{mg_n}.{wb}"] = take(f"model.multi_modal_projector.{hf_n}.{wb}")
    # --- language model
    lp = "model.language_model."
    tc = hf_cfg.text_config
    out["language_model.embedding.word_embeddings.weight"] = take(lp + "embed_tokens.weight")
    for i in range(tc.num_hidden_layers):
        h, m = f"{lp}layers.{i}.", f"language_model.decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = take(h + "input_layernorm.weight")
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            take(h + "self_attn.q_proj.weight"),
            take(h + "self_attn.k_proj.weight"),
            take(h + "self_attn.v_proj.weight"),
            tc.num_attention_heads,
            tc.num_key_value_heads,
        )
        out[m + "self_attention.linear_proj.weight"] = take(h + "self_attn.o_proj.weight")
        out[m + "pre_mlp_layernorm.weight"] = take(h + "post_attention_layernorm.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [take(h + "mlp.gate_proj.weight"), take(h + "mlp.up_proj.weight")][:: -1 if SWAP_GATE_UP else 1], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = take(h + "mlp.down_proj.weight")
    out["language_model.decoder.final_layernorm.weight"] = take(lp + "norm.weight")
    out["language_model.output_layer.weight"] = take("lm_head.weight")
    unused = sorted(set(hf_sd) - used)
    return out, unused


# --------------------------------------------------------------------------------------------- run
def main():
    torch.set_default_dtype(torch.float32)
    hf = build_hf()
    hf_batch, mg_batch = make_batch()

    with torch.no_grad():
        hf_out = hf(
            input_ids=hf_batch["input_ids"],
            pixel_values=hf_batch["pixel_values"],
            labels=hf_batch["labels"],
            return_dict=True,
        )
    hf_loss = hf_out.loss.item()
    # HF per-token losses with its own shift, for a position-by-position comparison
    shift_logits = hf_out.logits[:, :-1]
    shift_labels = hf_batch["labels"][:, 1:]

    with megatron_world(), llava_cpu_patches():
        mg, (lcfg, vcfg, pcfg, rope_theta) = build_megatron(hf.config)
        mg_sd, unused = hf_to_megatron(hf.state_dict(), hf.config)
        own = mg.state_dict()
        print(f"megatron state dict: {len(own)} keys; mapped: {len(mg_sd)} keys")
        print("HF keys not mapped (expected: the last CLIP layer and post_layernorm):")
        for k in unused:
            print("   ", k)
        for k, v in mg_sd.items():
            if k in own and own[k].shape != v.shape:
                raise SystemExit(f"shape mismatch {k}: megatron {tuple(own[k].shape)} vs mapped {tuple(v.shape)}")
        res = mg.load_state_dict(mg_sd, strict=False)
        print("missing keys   :", res.missing_keys)
        print("unexpected keys:", res.unexpected_keys)
        mg.load_state_dict(mg_sd, strict=True)
        print("load_state_dict(strict=True): OK")

        with torch.no_grad():
            per_token, new_loss_mask = mg(
                images=mg_batch["images"],
                input_ids=mg_batch["input_ids"],
                position_ids=mg_batch["position_ids"],
                attention_mask=None,
                labels=mg_batch["labels"],
                loss_mask=mg_batch["loss_mask"],
            )
            # logits too (no labels) for localisation
            mg_logits, _ = mg(
                images=mg_batch["images"],
                input_ids=mg_batch["input_ids"],
                position_ids=mg_batch["position_ids"],
                attention_mask=None,
            )
            # vision features: megatron vision tower vs HF hidden_states[-2][:, 1:]
            mg_vis = mg.vision_model(mg_batch["images"])[:, 1:]
            mg_proj = mg.vision_projection(mg_vis.permute(1, 0, 2).contiguous()).permute(1, 0, 2)
            hf_vis_out = hf.model.vision_tower(mg_batch["images"], output_hidden_states=True)
            hf_vis = hf_vis_out.hidden_states[VISION_FEATURE_LAYER][:, 1:]
            hf_proj = hf.model.multi_modal_projector(hf_vis)

    mg_loss = ((per_token * new_loss_mask).sum() / new_loss_mask.sum()).item()

    print()
    print(f"vision features   max|diff| = {(mg_vis - hf_vis).abs().max().item():.3e}")
    print(f"projector output  max|diff| = {(mg_proj - hf_proj).abs().max().item():.3e}")
    # megatron logits are [b, s, V] (GPTModel transposes back) at combined positions == HF expanded positions
    print(f"logits shapes: megatron {tuple(mg_logits.shape)}  HF {tuple(hf_out.logits.shape)}")
    print(f"logits (all pos)  max|diff| = {(mg_logits - hf_out.logits).abs().max().item():.3e}")

    # per-token comparison: HF position i (i < S-1) predicts labels[i+1]
    hf_tok = F.cross_entropy(
        shift_logits.reshape(-1, T_VOCAB), shift_labels.reshape(-1), ignore_index=-100, reduction="none"
    ).reshape(shift_labels.shape)
    hf_mask = (shift_labels != -100).float()
    mg_mask = new_loss_mask[:, :-1]
    print(f"loss masks agree: {torch.equal(hf_mask, mg_mask)}  (tokens in loss: {int(hf_mask.sum())})")
    print(f"per-token loss    max|diff| = {((per_token[:, :-1] - hf_tok) * hf_mask).abs().max().item():.3e}")

    diff = abs(mg_loss - hf_loss)
    print()
    print(f"HF       loss = {hf_loss:.8f}")
    print(f"megatron loss = {mg_loss:.8f}")
    print(f"|diff| = {diff:.3e}   relative = {diff / abs(hf_loss):.3e}")
    ok = diff / abs(hf_loss) < 1e-5
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


def megatron_loss(hf, mg_batch, skip=()):
    """Build LLaVAModel, load the mapped HF weights, return the masked-mean loss (for --checks)."""
    with megatron_world(), llava_cpu_patches(skip):
        mg, _ = build_megatron(hf.config)
        sd, _ = hf_to_megatron(hf.state_dict(), hf.config)
        mg.load_state_dict(sd, strict=True)
        with torch.no_grad():
            per_token, mask = mg(
                images=mg_batch["images"],
                input_ids=mg_batch["input_ids"],
                position_ids=mg_batch["position_ids"],
                attention_mask=None,
                labels=mg_batch["labels"],
                loss_mask=mg_batch["loss_mask"],
            )
    return ((per_token * mask).sum() / mask.sum()).item(), int(mask.sum())


def checks():
    """Evidence for FINDINGS.md: each CPU patch is needed; the comparison is sensitive to the mapping; the
    label convention around images."""
    global NAIVE_QKV, SWAP_GATE_UP
    hf = build_hf()
    hf_batch, mg_batch = make_batch()
    with torch.no_grad():
        hf_loss = hf(**hf_batch, return_dict=True).loss.item()
    print(f"reference HF loss {hf_loss:.8f}")

    print("\n-- 1. each CPU patch removed in turn")
    for skip in ("ln_pre", "cuda_copy", "cuda_device"):
        try:
            loss, _ = megatron_loss(hf, mg_batch, skip=(skip,))
            print(f"without {skip:12s}: ran, loss {loss:.8f}")
        except BaseException as e:  # noqa: BLE001 - we want to print whatever megatron raises
            print(f"without {skip:12s}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    print("   alternative to the CpuTorch patch: pass sound_clips=torch.empty(0) to forward")
    with megatron_world(), llava_cpu_patches(skip=("cuda_device",)):
        mg, _ = build_megatron(hf.config)
        mg.load_state_dict(hf_to_megatron(hf.state_dict(), hf.config)[0], strict=True)
        with torch.no_grad():
            pt, m = mg(**{k: mg_batch[k] for k in ("images", "input_ids", "position_ids", "labels", "loss_mask")},
                       attention_mask=None, sound_clips=torch.empty(0))
        print(f"   with sound_clips=torch.empty(0): loss {((pt * m).sum() / m.sum()).item():.8f}")

    print("\n-- 2. negative controls (the comparison is sensitive to the mapping)")
    NAIVE_QKV = True
    print(f"plain [q;k;v] concat (no per-group interleave): loss {megatron_loss(hf, mg_batch)[0]:.8f}")
    NAIVE_QKV = False
    SWAP_GATE_UP = True
    print(f"linear_fc1 = [up; gate]                        : loss {megatron_loss(hf, mg_batch)[0]:.8f}")
    SWAP_GATE_UP = False

    print("\n-- 3. label quirk: answer token right after the image")
    # make the first text token after sample 0's image a label token on both sides
    img_end = (hf_batch["input_ids"][0] == IMAGE_TOKEN).nonzero().max().item()
    hf_batch["labels"][0, img_end + 1] = hf_batch["input_ids"][0, img_end + 1]
    j = (mg_batch["input_ids"][0] == IMAGE_TOKEN).nonzero().item()
    mg_batch["labels"][0, j] = hf_batch["input_ids"][0, img_end + 1]
    mg_batch["loss_mask"] = (mg_batch["labels"] != -100).float()
    with torch.no_grad():
        hf_loss2 = hf(**hf_batch, return_dict=True).loss.item()
    mg_loss2, n = megatron_loss(hf, mg_batch)
    print(f"HF loss {hf_loss2:.8f} over {int((hf_batch['labels'][:, 1:] != -100).sum())} tokens; "
          f"megatron loss {mg_loss2:.8f} over {n} tokens (the last image position is always loss-masked)")


def shard_for_rank(full_sd, model, rank, tp):
    """Cut the TP=1 megatron state dict for one TP rank, from the params' own TP attributes."""
    params = dict(model.named_parameters())
    out = {}
    for k, v in full_sd.items():
        p = params.get(k)
        if p is None or not getattr(p, "tensor_model_parallel", False):
            out[k] = v  # replicated: norms, row-parallel biases, conv1, class token, position embeddings
            continue
        dim = p.partition_dim
        if k.startswith("language_model.") and k.endswith("mlp.linear_fc1.weight"):
            gate, up = v.chunk(2, dim=0)  # GLU: each rank holds [gate_r; up_r]
            out[k] = torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0)
        else:
            # linear_qkv: the per-group layout makes a contiguous split hand each rank whole query groups
            out[k] = v.chunk(tp, dim=dim)[rank]
        assert out[k].shape == p.shape, (k, out[k].shape, p.shape)
    return out


def _tp_rank(rank, tp, port, hf, mg_batch, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp),
                      LOCAL_RANK=str(rank))
    try:
        with megatron_world(tp), llava_cpu_patches():
            mg, _ = build_megatron(hf.config, tp)
            full, _ = hf_to_megatron(hf.state_dict(), hf.config)
            mg.load_state_dict(shard_for_rank(full, mg, rank, tp), strict=True)
            with torch.no_grad():
                per_token, mask = mg(
                    images=mg_batch["images"],
                    input_ids=mg_batch["input_ids"],
                    position_ids=mg_batch["position_ids"],
                    attention_mask=None,
                    labels=mg_batch["labels"],
                    loss_mask=mg_batch["loss_mask"],
                )
                tp_sizes = {
                    "vision qkv": tuple(mg.vision_model.decoder.layers[0].self_attention.linear_qkv.weight.shape),
                    "projector fc1": tuple(mg.vision_projection.encoder.linear_fc1.weight.shape),
                    "lm qkv": tuple(mg.language_model.decoder.layers[0].self_attention.linear_qkv.weight.shape),
                }
        q.put((rank, ((per_token * mask).sum() / mask.sum()).item(), tp_sizes, None))
    except BaseException:  # noqa: BLE001
        import traceback

        q.put((rank, None, None, traceback.format_exc()))


def tp2():
    """TP=2 in two forked CPU processes (gloo): LLaVAModel shards the vision tower with the language TP group."""
    import multiprocessing as mp

    from loongforge_megatron.engine.parallel_state import free_port

    hf = build_hf()
    hf_batch, mg_batch = make_batch()
    with torch.no_grad():
        hf_loss = hf(**hf_batch, return_dict=True).loss.item()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_tp_rank, args=(r, 2, port, hf, mg_batch, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, loss, sizes, err in results:
        if err:
            print(f"rank {rank} failed:\n{err}")
            return 1
        print(f"rank {rank}: megatron TP=2 loss {loss:.8f}  local shapes {sizes}")
    diff = abs(results[0][1] - hf_loss)
    print(f"HF loss {hf_loss:.8f}  |diff| = {diff:.3e}  relative = {diff / abs(hf_loss):.3e}")
    return 0 if diff / abs(hf_loss) < 1e-5 else 1


if __name__ == "__main__":
    if "--tp2" in sys.argv:
        sys.exit(tp2())
    if "--checks" in sys.argv:
        checks()
        sys.exit(0)
    sys.exit(main())
