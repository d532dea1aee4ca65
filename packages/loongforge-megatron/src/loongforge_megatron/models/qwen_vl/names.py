"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) and Qwen3-VL (``Qwen3VLForConditionalGeneration``) <->
:class:`~.model.QwenVLModel` names.

HF names are the checkpoint files' (the hub's, and what transformers' ``save_pretrained`` writes): the language
model is the GPT map of its family (Qwen2's: q/k/v biases: ``model.layers.*``, ``model.embed_tokens``,
``lm_head``); the vision tower keeps transformers' names under ``vision.`` (megatron) / ``visual.`` (HF), on the
first pipeline stage, split like megatron's layers (:func:`_rule`) or whole on every rank. Files that spell the module paths of transformers 5's model
(``model.language_model.*``, ``model.visual.*``) are read through :func:`hf_alias`. Qwen3-VL's files use those
module paths themselves (:func:`name_map_3`: Qwen3's language model, with q/k norms; Qwen3-VL-MoE's a Qwen3-MoE
whose experts are fused 3-D tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from loongforge.checkpoint import ColumnParallel, Entry, NameMap, Replicated, RowParallel
from loongforge.checkpoint.mapping import Rule
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.sizes import Sizes
from loongforge_megatron.models.gpt.names import HFConfig, decoder

V = "visual."
LM = "model.language_model."


def complete_config(h: HFConfig) -> HFConfig:
    """The config as transformers 5 reads it (a hub config of transformers 4 lists the text fields at the top
    level and ``rope_scaling`` instead of ``rope_parameters``)."""
    from transformers import AutoConfig

    kind = h.get("model_type")
    cls = type(AutoConfig.for_model(kind))
    full = cls.from_dict(dict(h)).to_dict()
    return {k: v for k, v in full.items() if v is not None}


def text_config(h: HFConfig) -> HFConfig:
    t = dict(h.get("text_config") or {})
    # NOTE: transformers ties the head by the top-level config's flag; a text config's own may differ (Qwen3-VL-MoE's
    # defaults to true while the model's defaults to false)
    t["tie_word_embeddings"] = h.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    return t


def mrope_section(h: HFConfig) -> list[int]:
    t = text_config(h)
    params = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if "mrope_section" not in params:
        raise CheckpointError("qwen_vl: the text config has no rope_parameters.mrope_section")
    return list(params["mrope_section"])


# NOTE: the tower's rules when it is split like the language model (parallel.components.vision.tp = tp); kept whole
# (the default) the layout holds it at tp 1 (``whole``), where every rule is the whole tensor
_COLUMN, _QKV, _ROW, _SAME = ColumnParallel(), ColumnParallel(stride=3), RowParallel(), Replicated()


def _rule(name: str) -> Rule:
    """A tower tensor's tensor-parallel rule: q / k / v rows split by heads, column- then row-parallel MLPs and
    mergers (row-parallel biases whole), everything else (norms, embeddings) whole."""
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return _QKV
    if name.endswith(("attn.proj.weight", "down_proj.weight", "mlp.2.weight", "linear_fc2.weight")):
        return _ROW
    if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias", "mlp.0.weight",
                      "mlp.0.bias", "linear_fc1.weight", "linear_fc1.bias")):
        return _COLUMN
    return _SAME


def _tower_shape(name: str) -> Callable[[Sizes], tuple]:
    """A tower tensor's HF shape from ``vision_config`` (Qwen2.5-VL's and Qwen3-VL's towers: the merger's input is
    spatial_merge_size**2 patches; Qwen3-VL's deepstack mergers normalise after that shuffle)."""
    leaf = name.rsplit(".", 1)[-1]
    part = name.split(".")[-2]

    def shape(c: Sizes) -> tuple:
        v = c.sub("vision_config")
        h, merged = v["hidden_size"], v["hidden_size"] * v["spatial_merge_size"] * v["spatial_merge_size"]
        if name.startswith("patch_embed."):
            if leaf == "bias":
                return (h,)
            size = v["patch_size"]
            return (h, v.get("in_channels") or v.get("in_chans", 3), v["temporal_patch_size"], size, size)
        if name == "pos_embed.weight":
            return (v["num_position_embeddings"], h)
        if name.startswith(("merger.", "deepstack_merger_list.")):
            out = v["out_hidden_size"]
            if part in ("ln_q", "norm"):
                return (merged if name.startswith("deepstack") else h,)
            if part in ("0", "linear_fc1"):
                return (merged, merged) if leaf == "weight" else (merged,)
            return (out, merged) if leaf == "weight" else (out,)
        # blocks.{i}.*
        ffn = v["intermediate_size"]
        if part in ("norm1", "norm2"):
            return (h,)
        if part == "qkv":
            return (3 * h, h) if leaf == "weight" else (3 * h,)
        if part in ("gate_proj", "up_proj", "linear_fc1"):
            return (ffn, h) if leaf == "weight" else (ffn,)
        if part in ("down_proj", "linear_fc2"):
            return (h, ffn) if leaf == "weight" else (h,)
        return (h, h) if leaf == "weight" else (h,)  # attn.proj

    return shape


def _tower_key(name: str) -> str:
    """The name without its block index (one shape function per kind of tower tensor)."""
    parts = name.split(".")
    return ".".join(parts[2:]) if parts[0] == "blocks" else name


def _tower_entries(names: list[str], hf_prefix: str) -> list[Entry]:
    shapes: dict[str, Callable[[Sizes], tuple]] = {}
    out = []
    for n in names:
        key = _tower_key(n)
        if key not in shapes:
            shapes[key] = _tower_shape(key)
        out.append(Entry("vision." + n, hf_prefix + n, _rule(n), stage="first", shape=shapes[key]))
    return out


def _in_text_config(entry: Entry) -> Entry:
    """A language-model entry whose HF shape reads ``text_config``."""
    if entry.shape is None:
        return entry
    inner = entry.shape
    return replace(entry, shape=lambda c: inner(c.sub("text_config")))


def config_checks(c: Sizes) -> None:
    """What no tensor shape shows: the rotary sections cover the head's half dims; special tokens are in the
    vocabulary."""
    t = c.sub("text_config")
    params = t.raw("rope_parameters") or t.raw("rope_scaling") or {}
    section = params.get("mrope_section") if isinstance(params, dict) else None
    head = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    if not isinstance(section, list) or not section or not all(type(s) is int and s > 0 for s in section):
        raise CheckpointError(f"{c.where}: key 'text_config.rope_parameters.mrope_section' must be a list of positive "
                              f"integers (the rotary sections for time, height, width), got {section!r:.40}")
    # NOTE: a partial rotary factor (a hybrid language model's 0.25) rotates the leading share of the head's dims only
    partial = params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0
    if type(partial) not in (int, float) or not 0 < partial <= 1:
        raise CheckpointError(f"{c.where}: key 'text_config.rope_parameters.partial_rotary_factor' must be a number "
                              f"in (0, 1], got {partial!r:.40}")
    half = int(head.value * partial) // 2
    if sum(section) != half:
        raise CheckpointError(f"{c.where}: key 'text_config.rope_parameters.mrope_section' {section} sums to "
                              f"{sum(section)}, not half the rotary dims ({head.keys} x partial_rotary_factor "
                              f"{partial}: {half})")
    vocab = t["vocab_size"].value
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        v = c.raw(key)
        if v is not None and (type(v) is not int or not 0 <= v < vocab):
            raise CheckpointError(f"{c.where}: key '{key}' must be a token id below text_config.vocab_size {vocab}, "
                                  f"got {v!r:.40}")


def _vision(h: HFConfig) -> list[Entry]:
    v = h["vision_config"]
    names = ["patch_embed.proj.weight", "merger.ln_q.weight", "merger.mlp.0.weight", "merger.mlp.0.bias",
             "merger.mlp.2.weight", "merger.mlp.2.bias"]
    per_block = ["norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                 "attn.proj.bias"] + [f"mlp.{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias")]
    names += [f"blocks.{i}.{n}" for i in range(v["depth"]) for n in per_block]
    return _tower_entries(names, V)


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    t = text_config(h)
    lm = decoder(t, divisible_by=divisible_by, qkv_bias=True)
    return NameMap(_vision(h) + [_in_text_config(e) for e in lm.entries])


def _vision_3(h: HFConfig) -> list[Entry]:
    v = h["vision_config"]
    lin = [f"{n}.{w}" for n in ("linear_fc1", "linear_fc2", "norm") for w in ("weight", "bias")]
    names = ["patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight"] + [f"merger.{n}" for n in lin]
    names += [f"deepstack_merger_list.{j}.{n}" for j in range(len(v.get("deepstack_visual_indexes", []))) for n in lin]
    per_block = [f"{n}.{w}" for n in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
                 for w in ("weight", "bias")]
    names += [f"blocks.{i}.{n}" for i in range(v["depth"]) for n in per_block]
    return _tower_entries(names, "model.visual.")


def _language(entry: Entry) -> Entry:
    """A GPT entry under ``model.language_model.`` (the head stays ``lm_head``)."""
    def move(name: str) -> str:
        return LM + name[len("model."):] if name.startswith("model.") else name

    pats = {r: move(n) for r, n in entry.hf_patterns().items()}
    return replace(entry, hf=pats[next(iter(pats))] if isinstance(entry.hf, str) else pats)


def with_tower(h: HFConfig, lm: NameMap) -> NameMap:
    """A Qwen3-VL tower (``model.visual.``) in front of the language model map ``lm`` of ``text_config`` (its
    ``model.*`` names moved under ``model.language_model.``): the map of a Qwen3-VL-style model whose language
    model is another family's."""
    return NameMap(_vision_3(h) + [_in_text_config(_language(e)) for e in lm.entries])


def name_map_3(h: HFConfig, *, divisible_by: int = 128, moe: bool = False) -> NameMap:
    """Qwen3-VL: Qwen3 layers (q/k norms, no biases) under ``model.language_model.``, the tower ``model.visual.``;
    ``moe``: Qwen3-VL-MoE's Qwen3-MoE layers, whose experts the files fuse into 3-D tensors."""
    from loongforge_megatron.models.gpt import qwen3_moe

    t = text_config(h)
    lm = (qwen3_moe.name_map(t, divisible_by=divisible_by, fused=True) if moe else
          decoder(t, divisible_by=divisible_by, qk_norm=True, qkv_bias=bool(t.get("attention_bias"))))
    return NameMap(_vision_3(h) + [_in_text_config(_language(e)) for e in lm.entries])


def hf_alias(name: str) -> str:
    """A tensor name as transformers 5's module paths spell it -> the checkpoint files' spelling."""
    if name.startswith("model.visual."):
        return name[len("model."):]
    if name.startswith(LM):
        return "model." + name[len(LM):]
    return name


def module_path(name: str) -> str:
    """A checkpoint file's tensor name -> the module path of transformers' model (the inverse of :func:`hf_alias`)."""
    if name.startswith(V):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.visual.", LM)):
        return LM + name[len("model."):]
    return name
