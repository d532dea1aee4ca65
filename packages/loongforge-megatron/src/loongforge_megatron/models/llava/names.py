"""LLaVA (``LlavaForConditionalGeneration``: CLIP vision tower + MLP projector + Llama) <-> megatron-core's
``LLaVAModel`` (local specs). Verified against transformers in ``docs/design/vlm_llava_on_megatron.md``.

megatron's CLIP tower has no "feature layer": it is built with only the layers LLaVA reads
(``vision_feature_layer = -2``: all but the last) and no post-layernorm, so those HF tensors are not mapped
(``ignore_hf``). HF names follow the hub's llava-hf checkpoints (``vision_tower.vision_model.*``); transformers 5
writes ``vision_tower.*`` without ``vision_model.``, which ``hf_alias`` maps. Pipeline parallelism is not supported
(the vision entries sit on the first stage with explicit layer indices).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import torch
from loongforge.checkpoint import ColumnParallel, Entry, FusedQKV, NameMap, Replicated, Reshaped, RowParallel
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.sizes import Sizes
from loongforge_megatron.models.gpt.names import HFConfig, dense_mlp, ends, gqa_attention, norms

V = "vision_tower.vision_model."
_VISION_LAYER = re.compile(r"^vision_tower\.vision_model\.encoder\.layers\.(\d+)\.")


def complete_config(h: HFConfig) -> HFConfig:
    """The config with transformers' defaults filled in: hub checkpoints (llava-hf/llava-1.5-7b-hf) list only the
    fields of text_config / vision_config that differ from Llama's and CLIP's defaults."""
    from transformers import LlavaConfig

    full = LlavaConfig.from_dict(h).to_dict()
    full["image_token_index"] = h.get("image_token_index", h.get("image_token_id", full.get("image_token_index")))
    return {k: v for k, v in full.items() if v is not None}


def text_config(h: HFConfig) -> HFConfig:
    return {"model_type": "llama", **(h.get("text_config") or {})}


def vision_layers_used(h: HFConfig) -> int:
    """How many CLIP layers LLaVA reads: ``hidden_states[vision_feature_layer]`` is the output of that many."""
    n, k = h["vision_config"]["num_hidden_layers"], h.get("vision_feature_layer", -2)
    if not isinstance(k, int):
        raise CheckpointError(f"llava: vision_feature_layer {k!r} (several layers) is not supported")
    used = n + 1 + k if k < 0 else k
    if not 1 <= used <= n:
        raise CheckpointError(f"llava: vision_feature_layer {k} does not select one of the {n} CLIP layers")
    return used


def _clip(name: str) -> Callable[[Sizes], tuple]:
    """A CLIP tower / projector tensor's HF shape from ``vision_config`` / ``text_config``."""
    def shape(c: Sizes) -> tuple:
        v = c.sub("vision_config")
        h, leaf = v["hidden_size"], name.rsplit(".", 1)[-1]
        if name == "patch":
            return (h, v.get("num_channels", 3), v["patch_size"], v["patch_size"])
        if name == "positions":
            side = v["image_size"] // v["patch_size"]
            return (side * side + 1, h)
        if name.startswith("projector."):
            t = c.sub("text_config")["hidden_size"]
            return ((t, h if "linear_1" in name else t) if leaf == "weight" else (t,))
        if name.startswith("fc1."):
            return (v["intermediate_size"], h) if leaf == "weight" else (v["intermediate_size"],)
        if name.startswith("fc2."):
            return (h, v["intermediate_size"]) if leaf == "weight" else (h,)
        if name.startswith("square."):
            return (h, h) if leaf == "weight" else (h,)
        return (h,)

    return shape


_CLIP = {k: _clip(k) for k in ("patch", "positions", "vector", "square.weight", "square.bias", "fc1.weight", "fc1.bias",
                               "fc2.weight", "fc2.bias", "projector.linear_1.weight", "projector.linear_2.weight",
                               "projector.bias")}


def _clip_kind(hf: str) -> str:
    leaf = hf.rsplit(".", 1)[-1]
    if "_proj." in hf:
        return f"square.{leaf}"
    if ".fc1." in hf or ".fc2." in hf:
        return hf.split(".")[-2] + "." + leaf
    return "vector"


def _vision(h: HFConfig) -> list[Entry]:
    v = h["vision_config"]
    heads, hidden = v["num_attention_heads"], v["hidden_size"]
    qkv = FusedQKV(num_heads=heads, num_query_groups=heads, head_dim=hidden // heads)
    out = [
        Entry("vision_model.conv1.weight", V + "embeddings.patch_embedding.weight", Replicated(), stage="first",
              shape=_CLIP["patch"]),
        Entry("vision_model.class_token", V + "embeddings.class_embedding",
              Reshaped(shape=(1, 1, hidden), hf_shape=(hidden,)), stage="first", shape=_CLIP["vector"]),
        Entry("vision_model.position_embeddings.weight", V + "embeddings.position_embedding.weight", Replicated(),
              stage="first", shape=_CLIP["positions"]),
        Entry("vision_model.ln_pre.weight", V + "pre_layrnorm.weight", Replicated(), stage="first",
              shape=_CLIP["vector"]),
        Entry("vision_model.ln_pre.bias", V + "pre_layrnorm.bias", Replicated(), stage="first", shape=_CLIP["vector"]),
    ]
    for i in range(vision_layers_used(h)):
        m, hf = f"vision_model.decoder.layers.{i}.", f"{V}encoder.layers.{i}."
        rules = [
            ("input_layernorm.weight", "layer_norm1.weight", Replicated()),
            ("input_layernorm.bias", "layer_norm1.bias", Replicated()),
            ("self_attention.linear_qkv.weight", {r: f"self_attn.{r}_proj.weight" for r in "qkv"}, qkv),
            ("self_attention.linear_qkv.bias", {r: f"self_attn.{r}_proj.bias" for r in "qkv"}, qkv),
            ("self_attention.linear_proj.weight", "self_attn.out_proj.weight", RowParallel()),
            ("self_attention.linear_proj.bias", "self_attn.out_proj.bias", Replicated()),
            ("pre_mlp_layernorm.weight", "layer_norm2.weight", Replicated()),
            ("pre_mlp_layernorm.bias", "layer_norm2.bias", Replicated()),
            ("mlp.linear_fc1.weight", "mlp.fc1.weight", ColumnParallel()),
            ("mlp.linear_fc1.bias", "mlp.fc1.bias", ColumnParallel()),
            ("mlp.linear_fc2.weight", "mlp.fc2.weight", RowParallel()),
            ("mlp.linear_fc2.bias", "mlp.fc2.bias", Replicated()),
        ]
        for meg, names, rule in rules:
            hf_names = hf + names if isinstance(names, str) else {r: hf + n for r, n in names.items()}
            one = names if isinstance(names, str) else next(iter(names.values()))
            out.append(Entry(m + meg, hf_names, rule, stage="first", shape=_CLIP[_clip_kind(hf + one)]))
    p, q = "vision_projection.encoder.", "multi_modal_projector."
    out += [
        Entry(p + "linear_fc1.weight", q + "linear_1.weight", ColumnParallel(), stage="first",
              shape=_CLIP["projector.linear_1.weight"]),
        Entry(p + "linear_fc1.bias", q + "linear_1.bias", ColumnParallel(), stage="first", shape=_CLIP["projector.bias"]),
        Entry(p + "linear_fc2.weight", q + "linear_2.weight", RowParallel(), stage="first",
              shape=_CLIP["projector.linear_2.weight"]),
        Entry(p + "linear_fc2.bias", q + "linear_2.bias", Replicated(), stage="first", shape=_CLIP["projector.bias"]),
    ]
    return out


def _language(entry: Entry) -> Entry:
    """A Llama entry moved under LLaVA's names: ``language_model.`` on both sides (HF: ``language_model.model.*``,
    ``language_model.lm_head``)."""
    pats = {r: "language_model." + n for r, n in entry.hf_patterns().items()}
    hf = pats[next(iter(pats))] if isinstance(entry.hf, str) else pats
    inner = entry.shape
    shape = None if inner is None else (lambda c: inner(c.sub("text_config")))
    return replace(entry, megatron="language_model." + entry.megatron, hf=hf, shape=shape)


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    if h.get("vision_feature_select_strategy", "default") != "default" or not h.get("multimodal_projector_bias", True):
        raise CheckpointError("llava: only vision_feature_select_strategy 'default' with projector biases is supported")
    t = text_config(h)
    if t.get("attention_bias") or t.get("mlp_bias"):
        raise CheckpointError("llava: a language model with attention_bias / mlp_bias is not supported")
    first, last = ends(t, divisible_by=divisible_by)
    language = first + norms() + gqa_attention(t) + dense_mlp() + last
    return NameMap(_vision(h) + [_language(e) for e in language])


def config_checks(c: Sizes) -> None:
    """What no tensor shape shows: the image token is in the vocabulary."""
    vocab = c.sub("text_config")["vocab_size"].value
    v = c.raw("image_token_index")
    if type(v) is not int or not 0 <= v < vocab:
        raise CheckpointError(f"{c.where}: key 'image_token_index' must be a token id below text_config.vocab_size "
                              f"{vocab}, got {v!r:.40}")


def ignore_hf(h: HFConfig, name: str) -> bool:
    """CLIP layers past the feature layer and the post-layernorm (only HF's pooler reads them)."""
    if name.startswith(V + "post_layernorm.") or "rotary_emb.inv_freq" in name:
        return True
    m = _VISION_LAYER.match(name)
    return bool(m) and int(m.group(1)) >= vision_layers_used(h)


def hf_extra(h: HFConfig) -> dict[str, torch.Tensor]:
    """CLIP's post-layernorm, which only HF's pooler reads (LLaVA takes the pre-norm hidden states): megatron's
    tower has none, so the export writes an identity (weight 1, bias 0) to keep the HF checkpoint complete."""
    n = h["vision_config"]["hidden_size"]
    return {V + "post_layernorm.weight": torch.ones(n), V + "post_layernorm.bias": torch.zeros(n)}


def export_config(h: HFConfig) -> HFConfig:
    """The exported CLIP tower has the layers the model runs, read at ``vision_feature_layer = -1`` (the same
    features as the source's deeper tower at -2)."""
    used = vision_layers_used(h)
    return {**h, "vision_config": {**h["vision_config"], "num_hidden_layers": used}, "vision_feature_layer": -1}


def hf_alias(name: str) -> str:
    if name.startswith("vision_tower.") and not name.startswith(V):
        return V + name[len("vision_tower."):]
    return name
