"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) <-> :class:`~.model.QwenVLModel` names.

HF names are the checkpoint files' (the hub's, and what transformers' ``save_pretrained`` writes): the language
model is the GPT map of its family (Qwen2's: q/k/v biases: ``model.layers.*``, ``model.embed_tokens``,
``lm_head``); the vision tower keeps transformers' names under ``vision.`` (megatron) / ``visual.`` (HF), whole on
every rank (replicated) on the first pipeline stage. Files that spell the module paths of transformers 5's model
(``model.language_model.*``, ``model.visual.*``) are read through :func:`hf_alias`.
"""

from __future__ import annotations

from loongforge.checkpoint import Entry, NameMap, Replicated
from loongforge.errors import CheckpointError

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
    t.setdefault("tie_word_embeddings", h.get("tie_word_embeddings", False))
    return t


def mrope_section(h: HFConfig) -> list[int]:
    t = text_config(h)
    params = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if "mrope_section" not in params:
        raise CheckpointError("qwen_vl: the text config has no rope_parameters.mrope_section")
    return list(params["mrope_section"])


def _vision(h: HFConfig) -> list[Entry]:
    v = h["vision_config"]
    names = ["patch_embed.proj.weight", "merger.ln_q.weight", "merger.mlp.0.weight", "merger.mlp.0.bias",
             "merger.mlp.2.weight", "merger.mlp.2.bias"]
    per_block = ["norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                 "attn.proj.bias"] + [f"mlp.{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias")]
    names += [f"blocks.{i}.{n}" for i in range(v["depth"]) for n in per_block]
    return [Entry("vision." + n, V + n, Replicated(), stage="first") for n in names]


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    t = text_config(h)
    lm = decoder(t, divisible_by=divisible_by, qkv_bias=True)
    return NameMap(_vision(h) + lm.entries)


def hf_alias(name: str) -> str:
    """A tensor name as transformers 5's module paths spell it -> the checkpoint files' spelling."""
    if name.startswith("model.visual."):
        return name[len("model."):]
    if name.startswith(LM):
        return "model." + name[len(LM):]
    return name
