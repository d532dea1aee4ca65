"""LLaVA's model on megatron-core: ``LLaVAModel`` with local specs, its forward step, and its image-text data.

The configs and conventions are the ones verified against transformers' ``LlavaForConditionalGeneration`` in
``docs/design/vlm_llava_on_megatron.md``: the CLIP tower is built with only the layers LLaVA reads, its class token
is dropped. The CLIP tower and projector are built with their component's process groups
(``engine/component_groups.py``): split like the language model by default, or over a smaller tp group of their
own (``parallel.components.vision.tp``), with their own recompute. Context / sequence parallelism are not supported
here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from loongforge_megatron.data.epochs import ShuffledEpochs
from loongforge_megatron.engine.step import _to_device, loss_func


def image_size(arch: Any) -> tuple[int, int]:
    """(image side in pixels, patch side)."""
    v = arch.vision["vision_config"]
    return v.get("image_size", 224), v.get("patch_size", 32)


def image_seq_length(arch: Any) -> int:
    """Image embeddings per image after the class token is dropped (what one image token expands to)."""
    side, patch = image_size(arch)
    return (side // patch) ** 2


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: megatron's ``quick_gelu`` (``torch.compile``'d: one fused kernel) on a GPU, its eager
    function elsewhere (on the CPU, compiling it costs every process ~13 s for a one-line op)."""
    from megatron.core.activations import quick_gelu as fused

    if x.is_cuda:
        return fused(x)
    return getattr(fused, "_torchdynamo_orig_callable", fused)(x)


def vision_configs(language: Any, arch: Any, *, tp: int | None = None, recompute: str | None = None) -> tuple[Any, Any]:
    """megatron TransformerConfigs of the CLIP tower and the projector, sharing the language config's precision and
    fusion flags; ``tp`` / ``recompute``: the vision component's (None: the language model's)."""
    import torch.nn.functional as F

    from loongforge_megatron.models.llava.names import vision_layers_used

    v = arch.vision["vision_config"]
    acts = {"quick_gelu": quick_gelu, "gelu": F.gelu}
    if v.get("hidden_act", "quick_gelu") not in acts or arch.vision.get("projector_hidden_act", "gelu") != "gelu":
        raise ValueError(f"llava: vision activation '{v.get('hidden_act')}' / projector activation "
                         f"'{arch.vision.get('projector_hidden_act')}' (supported: quick_gelu or gelu / gelu)")
    heads = v["num_attention_heads"]
    # NOTE: use_te_activation_func (set by the loongforge spec's prepare_config for its SwiGLU module) would make
    # the CLIP and projector MLPs build an activation module from a spec they do not have.
    common = dict(num_query_groups=None, add_bias_linear=True, gated_linear_unit=False, qk_layernorm=False,
                  use_te_activation_func=False)
    # NOTE: the tower and projector are whole on the first pipeline stage (megatron would split their layers too)
    whole = dict(pipeline_model_parallel_size=1, num_layers_in_first_pipeline_stage=None,
                 num_layers_in_last_pipeline_stage=None, virtual_pipeline_model_parallel_size=None)
    if tp is not None:
        whole.update(tensor_model_parallel_size=tp, sequence_parallel=language.sequence_parallel and tp > 1)
    tower = dict(whole)
    if recompute is not None:  # NOTE: the tower's own recompute; the projector (one MLP) keeps none
        tower.update(recompute_granularity=None if recompute == "none" else recompute,
                     recompute_method="uniform" if recompute == "full" else None,
                     recompute_num_layers=1 if recompute == "full" else None)
    vision = dataclasses.replace(
        language, num_layers=vision_layers_used({"vision_config": v, **arch.vision}), hidden_size=v["hidden_size"],
        ffn_hidden_size=v["intermediate_size"], num_attention_heads=heads, kv_channels=v["hidden_size"] // heads,
        normalization="LayerNorm", layernorm_epsilon=v.get("layer_norm_eps", 1e-5), add_qkv_bias=True,
        activation_func=acts[v.get("hidden_act", "quick_gelu")], **common, **tower)
    vision.vision_model_type = "clip"  # NOTE: read by LLaVAModel; not a TransformerConfig field
    # NOTE: the projector is an MLP; its (unused) head count must still divide by TP.
    projection = dataclasses.replace(
        language, num_layers=1, hidden_size=language.hidden_size, ffn_hidden_size=language.hidden_size,
        num_attention_heads=language.num_attention_heads, activation_func=F.gelu, **common, **whole)
    return vision, projection


def _not_work_in_progress(record: logging.LogRecord) -> bool:
    return "LLaVA is work in progress" not in record.getMessage()


def layer_specs(spec: str, *, provider: str = "auto", accelerator: Any = None) -> tuple[Any, Any]:
    """(language layer spec, CLIP layer spec). ``local``: megatron's local specs. ``loongforge``: the language model
    gets our spec (SDPA flash attention, kernel RMSNorm / SwiGLU / RoPE) and CLIP megatron's local ViT layer with
    SDPA core attention (full attention: CLIP's mask type is no_mask); parameter names are the local specs', so
    checkpoints and the HF name maps are shared."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    vit = get_vit_layer_with_local_spec()
    if spec == "local":
        return get_gpt_layer_local_spec(normalization="RMSNorm"), vit
    if spec != "loongforge":
        raise ValueError(f"LLaVA layer spec {spec!r}; allowed: local, loongforge")
    from loongforge_megatron.layers import SDPAttention, loongforge_layer_spec
    from loongforge_megatron.layers.megatron_layers import with_own_group_row_linears

    attn = vit.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=SDPAttention))
    vit = dataclasses.replace(vit, submodules=dataclasses.replace(vit.submodules, self_attention=attn))
    return loongforge_layer_spec(provider=provider, accelerator=accelerator), with_own_group_row_linears(vit)


VISION_PREFIXES = ("vision_model.", "vision_projection.")  # the "vision" component: CLIP tower + projector


def build_llava(*, language: Any, arch: Any, vocab_size: int, max_sequence_length: int, device: torch.device,
                spec: str = "local", provider: str = "auto", accelerator: Any = None,
                vision_groups: Any = None, remote_encoder: bool = False) -> list[torch.nn.Module]:
    """``[LLaVAModel]`` for this rank (before DDP), built with :func:`layer_specs`. With pipeline parallelism the first stage
    holds the CLIP tower, the projector, the token embedding and the first language layers; later stages hold only
    their language layers (megatron's split), the last one the output layer.

    ``vision_groups`` (:func:`~loongforge_megatron.engine.component_groups.component_groups`) lays out the CLIP
    tower and the projector: at a tp below the language model's (e.g. 1: whole, no TP communication inside a small
    tower) they are built over the component's own tp group, and the CLIP copies in one language TP group encode
    different images of the micro-batch (``engine/encoder_split.py``: their gradients summed over the copies); the
    projector runs on every image on each copy (its gradients agree without a reduction: the language model's first
    column-parallel layers all-reduce the gradient of their input). Each shard is counted once by the gradient norm
    (``ComponentGroups.mark_shards``). ``remote_encoder``: CLIP and the projector run on ranks of their own
    (``engine/encoder_ranks.py``, :class:`LlavaEncoder`); the first stage reads their embeddings from its encoder
    cache as LLaVAModel's ``encoder_hidden_state`` (megatron's model without its encoder)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from loongforge_megatron.engine.model import _not_deprecation_notice
    from loongforge_megatron.layers.megatron_layers import row_parallel_linear

    # NOTE: megatron's per-build notices ("LLaVA is work in progress", "GPTModel IS DEPRECATED"): console noise.
    logging.getLogger("megatron.core.models.multimodal.llava_model").addFilter(_not_work_in_progress)
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_not_deprecation_notice)
    if spec == "loongforge":
        from loongforge_megatron.layers import prepare_config

        prepare_config(language)
    language_spec, vision_spec = layer_specs(spec, provider=provider, accelerator=accelerator)
    t = language.tensor_model_parallel_size if vision_groups is None else vision_groups.tp
    vision, projection = vision_configs(language, arch, tp=t,
                                        recompute=None if vision_groups is None else vision_groups.recompute)
    side, patch = image_size(arch)
    first, last = mpu.is_pipeline_first_stage(ignore_virtual=True), mpu.is_pipeline_last_stage(ignore_virtual=True)
    projection_spec = MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                    linear_fc2=row_parallel_linear() if spec == "loongforge" else RowParallelLinear)
    own = first and t != language.tensor_model_parallel_size
    if vision_groups is not None and t != language.tensor_model_parallel_size:
        # NOTE: collective (a tp-1 tower asks for a one-rank group): every rank, every pipeline stage
        collection = vision_groups.collection()
    from loongforge_megatron.models.llava.clip import clip_builder

    clip_builder()  # NOTE: LLaVAModel builds its CLIP tower through the run's llava-clip-torch-norms adaptation
    model = LLaVAModel(
        language_transformer_config=language,
        language_transformer_layer_spec=language_spec,
        language_vocab_size=vocab_size,
        language_max_sequence_length=max_sequence_length,
        # NOTE: LLaVAModel builds the tower over the language model's groups; at a tp of its own it is rebuilt
        # below over the component's
        vision_transformer_config=vision if not own else _at_tp(vision, language),
        vision_transformer_layer_spec=vision_spec,
        drop_vision_class_token=True,
        vision_projection_config=projection if not own else _at_tp(projection, language),
        vision_projection_layer_spec=projection_spec,
        vision_projection_type="mlp",
        parallel_output=True,  # NOTE: False with labels at TP > 1 adds ln(TP) to the loss (gathered logits)
        share_embeddings_and_output_weights=arch.tie_embeddings,
        language_position_embedding_type="rope",
        language_rotary_percent=1.0,
        language_rotary_base=int(arch.rope_theta),
        img_h=side,
        img_w=side,
        patch_dim=patch,
        image_token_index=arch.vision["image_token_index"],
        pre_process=first,
        post_process=last,
        add_encoder=first and not remote_encoder,
        add_decoder=True,
    )
    if first and remote_encoder:
        model.encoder_cache = None
        model.encoder_shape = functools.partial(_encoder_shape, seq=image_seq_length(arch), hidden=language.hidden_size)
    if own:
        _own_vision(model, vision, projection, vision_spec, projection_spec, groups=collection, side=side,
                    patch=patch)
    if first and vision_groups is not None:
        for module in (model.vision_model, model.vision_projection):
            vision_groups.mark_shards(module)
        if vision_groups.hdp > 1:  # NOTE: the copies of one language TP group encode different images
            from loongforge_megatron.engine.encoder_split import split_batch

            split_batch(model.vision_model, vision_groups)
    if first and vision_groups is not None and vision_groups.decoupled:
        # NOTE: the CLIP tower runs before the pipeline schedule (engine/decoupled_encoder.py)
        model.decoupled, model.encoder_cache = True, None
        model.encode_ahead = functools.partial(_encode_ahead, model)
    from megatron.core.enums import ModelType

    model.model_type = ModelType.encoder_or_decoder  # NOTE: megatron's schedules read it; LLaVAModel sets none
    # NOTE: CLIP's conv1 and the (Wrapped)TorchNorms are built in fp32 whatever params_dtype says.
    model.to(device=device, dtype=language.params_dtype)
    return [model]


def _at_tp(config: Any, language: Any) -> Any:
    """``config`` at the language model's tp (LLaVAModel's first build of the tower, over its groups)."""
    out = dataclasses.replace(config, tensor_model_parallel_size=language.tensor_model_parallel_size,
                              sequence_parallel=language.sequence_parallel)
    if hasattr(config, "vision_model_type"):
        out.vision_model_type = config.vision_model_type
    return out


def _own_vision(model: Any, vision: Any, projection: Any, vision_spec: Any, projection_spec: Any, *, groups: Any,
                side: int, patch: int) -> None:
    """Rebuild ``model``'s CLIP tower and projector over ``groups`` (the vision component's
    ProcessGroupCollection: its own tp group)."""
    from megatron.core.models.multimodal import llava_model
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector

    from loongforge_megatron.models.llava.clip import clip_builder

    # NOTE: llava_model's CLIPViTModel as the run's llava-clip-torch-norms adaptation has it (WrappedTorchNorm)
    model.vision_model = clip_builder()(vision, vision_spec, img_h=side, img_w=side, class_token_len=1,
                                      patch_dim=patch, model_subtype=vision.vision_model_type, add_class_token=True,
                                      pg_collection=groups, vp_stage=model.vp_stage)
    model.vision_model.register_load_state_dict_post_hook(llava_model._load_state_dict_hook_ignore_extra_state)
    model.vision_projection = MultimodalProjector(projection, projection_spec, "mlp", vision.hidden_size,
                                                  tp_group=groups.tp)


def _encoder_shape(batch: dict[str, Any], *, seq: int, hidden: int) -> tuple[int, int, int] | None:
    """The projector's output for one micro-batch's images (``[image embeddings, images, hidden]``), None
    without any."""
    n = batch["images"].shape[0]
    return (seq, n, hidden) if n else None


class LlavaEncoder(torch.nn.Module):
    """CLIP and the projector alone, for ranks that only encode (``parallel.components.vision.num_ranks``):
    ``vision_model.*`` / ``vision_projection.*`` as in LLaVAModel, so the name maps and checkpoints are the
    model's; :meth:`encode` is LLaVAModel's encoder path (class token dropped, ``[seq, images, hidden]``)."""

    def __init__(self, *, language: Any, arch: Any, spec: str = "local", provider: str = "auto",
                 accelerator: Any = None, recompute: str | None = None):
        from megatron.core.models.multimodal import llava_model
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules

        from loongforge_megatron.engine.encoder_split import EncoderTimer
        from loongforge_megatron.layers.megatron_layers import row_parallel_linear
        from loongforge_megatron.models.llava.clip import clip_builder

        super().__init__()
        if spec == "loongforge":
            from loongforge_megatron.layers import prepare_config

            prepare_config(language)
        _, vision_spec = layer_specs(spec, provider=provider, accelerator=accelerator)
        vision, projection = vision_configs(language, arch, tp=1, recompute=recompute)
        side, patch = image_size(arch)
        projection_spec = MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                        linear_fc2=row_parallel_linear() if spec == "loongforge" else RowParallelLinear)
        self.config, self.pre_process = language, True
        self.vision_model = clip_builder()(vision, vision_spec, img_h=side, img_w=side, class_token_len=1,
                                           patch_dim=patch, model_subtype=vision.vision_model_type,
                                           add_class_token=True)
        self.vision_model.register_load_state_dict_post_hook(llava_model._load_state_dict_hook_ignore_extra_state)
        self.vision_projection = MultimodalProjector(projection, projection_spec, "mlp", vision.hidden_size)
        self.vision_model.encoder_timer = EncoderTimer()

    def encode(self, batch: dict[str, Any]) -> torch.Tensor | None:
        from loongforge_megatron.engine.encoder_split import timed

        param = next(self.parameters())
        images = batch["images"].to(param.device, param.dtype)
        if not images.shape[0]:
            return None
        out = timed(self.vision_model, self.vision_model.encoder_timer, images.shape[0], images)
        out = out[:, self.vision_model.class_token_len:, :].permute(1, 0, 2).contiguous()
        return self.vision_projection(out)


def _encode_ahead(model: Any, batch: dict[str, Any]) -> torch.Tensor | None:
    """The CLIP tower's output for one micro-batch's images (None without any), for the decoupled encoder; the
    projector runs in the schedule, inside LLaVAModel's forward."""
    param = next(model.parameters())  # NOTE: the dtype forward_step gives the images
    images = batch["images"].to(param.device, param.dtype)
    return model.vision_model(images) if images.shape[0] else None


def forward_step(data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module):
    """megatron's ``forward_step_func`` for LLaVAModel: images + text with one image token per image; the model
    expands the image tokens and returns per-token losses with the matching loss mask. With the decoupled encoder
    (pipeline parallelism) the CLIP tower returns the output made for this micro-batch before the schedule."""
    from loongforge_megatron.engine.decoupled_encoder import replaying
    from loongforge_megatron.engine.model import unwrap

    device = next(model.parameters()).device
    batch = _to_device(next(data_iterator), device)
    images = batch["images"].to(next(model.parameters()).dtype)
    inner = unwrap(model)
    cache = getattr(inner, "encoder_cache", None)
    remote = cache is not None and not inner.add_encoder
    if remote:  # NOTE: an encoder on ranks of its own: LLaVAModel without its encoder reads encoder_hidden_state
        embeddings = cache.take()
        inner.encoder_hidden_state = embeddings if embeddings is not None else torch.zeros(
            0, 0, 0, dtype=images.dtype, device=device)
    with replaying(inner.vision_model, cache.take()) if cache is not None and not remote \
            else contextlib.nullcontext():
        losses, loss_mask = model(
            images=images, input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
            labels=batch["labels"], loss_mask=batch["loss_mask"],
            sound_clips=torch.empty(0, device=device),  # NOTE: "no sound"; None would ask torch.cuda for a device
        )
    return losses, functools.partial(loss_func, loss_mask)


class SyntheticImageText:
    """Deterministic image-text samples: ``[BOS, <image>, caption...]`` where the caption tokens are a function of
    the image (its mean colour per quadrant, quantised), so the loss can fall. ``seq_length`` is the length after
    the image token expands (text tokens = seq_length - image embeddings + 1). Labels are shifted like GPT's."""

    def __init__(self, *, arch: Any, seq_length: int, seed: int):
        self.side = image_size(arch)[0]
        self.image_token = arch.vision["image_token_index"]
        self.vocab = min(arch.vocab_size, self.image_token) if self.image_token >= 0 else arch.vocab_size
        self.text_len = seq_length - image_seq_length(arch) + 1
        if self.text_len < 3:
            raise ValueError(f"data.seq_length {seq_length} leaves no room for text after "
                             f"{image_seq_length(arch)} image embeddings")
        self.seed = seed

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        levels = torch.randint(0, 4, (2, 2, 3), generator=g).float()  # quadrant colours
        image = levels.repeat_interleave(self.side // 2, 0).repeat_interleave(self.side // 2, 1).permute(2, 0, 1)
        image = image / 3.0 + 0.05 * torch.randn(3, self.side, self.side, generator=g)
        words = (levels.flatten().long() + 4 * torch.arange(12)) % max(self.vocab - 2, 1) + 2
        caption = words.repeat(-(-(self.text_len - 2) // 12))[: self.text_len - 2]
        tokens = torch.cat([torch.tensor([1, self.image_token]), caption])
        labels = torch.cat([tokens[1:], torch.tensor([0])])
        loss_mask = torch.ones(self.text_len)
        loss_mask[0] = 0.0  # BOS predicts the image token: not a target
        loss_mask[-1] = 0.0  # nothing follows the last token
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "images": image.float(),
                "position_ids": torch.arange(self.text_len)}


class ImageTextConversations:
    """LLaVA-style records from a JSON / JSONL file: ``{"image": path, "conversations": [{"from": "human",
    "value": "<image>\\n..."}, {"from": "gpt", "value": ...}, ...]}`` (image paths relative to the file).

    Text goes through the tokenizer's chat template; the loss covers the assistant turns only (the SFT rule of the
    ``sft`` format); the prompt holds ``<image>`` once, which the tokenizer must map to the model's image token.
    Images go through CLIP's preprocessing (the HF model's ``preprocessor_config.json`` when there is one). Rows
    are padded (or cut) to the text length that expands to ``data.seq_length``. Records are visited in a seeded
    random order, a new one every epoch (a function of the sample index, so resume is exact); each is tokenized
    when first read (the first one at start, so a template or tokenizer mismatch shows before training).
    """

    def __init__(self, path: str, *, tokenizer: Any, arch: Any, seq_length: int, processor_dir: str | None = None,
                 seed: int = 0):
        import json
        from pathlib import Path

        from loongforge.errors import RecipeError

        self.file = Path(path)
        if not self.file.is_file():
            raise RecipeError(f"'{path}' is not a file of image-text records (JSON list or JSONL)", key="data.path")
        try:
            text = self.file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise RecipeError(f"{path}: not UTF-8 text (a binary file?); expected a JSON list or JSONL of records",
                              key="data.path") from None
        try:
            self.records = json.loads(text) if text.lstrip().startswith("[") else [
                json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise RecipeError(f"{path}: invalid JSON ({exc})", key="data.path") from None
        if not isinstance(self.records, list) or not self.records:
            raise RecipeError(f"{path}: no records (expected a JSON list or one JSON object per line)", key="data.path")
        self.image_token = arch.vision["image_token_index"]
        self.text_len = seq_length - image_seq_length(arch) + 1
        self.tokenizer = _with_text_chat_template(tokenizer)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.processor = _clip_processor(processor_dir, image_size(arch)[0])
        self.seed = seed
        self._record = ShuffledEpochs(len(self.records), seed)
        self._tokenized(0)

    def _tokenized(self, n: int) -> tuple[Any, list[int], list[int]]:
        """(image path, token ids, assistant mask) of record ``n`` (0-based), checked."""
        from loongforge.errors import RecipeError

        from loongforge_megatron.data.sft import to_messages, tokenize_conversation

        rec, where = self.records[n], f"{self.file}: record {n + 1}"
        if not isinstance(rec, dict) or "image" not in rec:
            raise RecipeError(f"{where} has no 'image'", key="data.path")
        try:
            ids, mask = tokenize_conversation(self.tokenizer, to_messages(rec, "sharegpt"))
        except (ValueError, TypeError) as exc:  # e.g. the template rejects a role order
            raise RecipeError(f"{where}: the chat template failed ({exc})".splitlines()[0], key="data.path") from None
        if ids.count(self.image_token) != 1:
            raise RecipeError(f"{where} holds {ids.count(self.image_token)} image tokens (id {self.image_token}) after "
                              "tokenization; its prompt needs '<image>' once and the tokenizer must map it to the "
                              "model's image_token_index", key="data.path")
        if ids.index(self.image_token) >= self.text_len:
            raise RecipeError(f"{where}: '<image>' comes after the first {self.text_len} tokens that fit "
                              "data.seq_length; shorten the prompt or raise seq_length", key="data.path")
        image = _confined_image(self.file, rec["image"], where)
        if not image.is_file():
            raise RecipeError(f"{where}: image '{image}' not found", key="data.path")
        return image, ids, mask

    def __len__(self) -> int:
        return 1 << 40  # NOTE: epochs follow one another; the record order is reshuffled in each

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        from PIL import Image

        n = self._record(idx)
        image, ids, mask = self._tokenized(n)
        try:
            with Image.open(image) as im:
                rgb = im.convert("RGB")
        except (OSError, ValueError) as exc:  # NOTE: PIL's UnidentifiedImageError and truncated files are OSErrors
            from loongforge.errors import RecipeError

            raise RecipeError(f"{self.file}: record {n + 1}: image '{image}' is unreadable "
                              f"({str(exc).splitlines()[0][:120]})", key="data.path") from None
        pixels = self.processor(images=rgb, return_tensors="pt")["pixel_values"][0]
        n = self.text_len
        ids, mask = ids[: n + 1], mask[: n + 1]
        ids = ids + [self.pad] * (n + 1 - len(ids))
        mask = mask + [0] * (n + 1 - len(mask))
        tokens = torch.tensor(ids[:n])
        return {"tokens": tokens, "labels": torch.tensor(ids[1:]), "loss_mask": torch.tensor(mask[1:], dtype=torch.float),
                "images": pixels.float(), "position_ids": torch.arange(n)}


# LLaVA-1.5's conversation format ("USER: <image>\n... ASSISTANT: ...</s>"), for tokenizers whose own template takes
# only processor-style content lists (llava-hf's) or that have none.
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }} {% elif m['role'] == 'user' %}"
    "USER: {{ m['content'] }} {% else %}ASSISTANT: {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def _with_text_chat_template(tokenizer: Any) -> Any:
    """``tokenizer`` if it has its own chat template and that renders plain-string content (with ``<image>``),
    else a copy with LLaVA-1.5's template."""
    import copy
    import sys

    from loongforge_megatron.data.tokenizer import DEFAULT_CHAT_TEMPLATE

    own = tokenizer.chat_template != DEFAULT_CHAT_TEMPLATE  # NOTE: load_tokenizer's stand-in for "none"
    if own:
        probe = [{"role": "user", "content": "<image>\nx"}, {"role": "assistant", "content": "y"}]
        try:
            if "<image>" in tokenizer.apply_chat_template(probe, tokenize=False):
                return tokenizer
        except Exception:  # noqa: BLE001 - a template for content lists only
            pass
        print("[data] llava: the tokenizer's chat template does not render text content; using LLaVA-1.5's "
              "'USER: ... ASSISTANT: ...' format", file=sys.stderr)
    tok = copy.copy(tokenizer)
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    return tok


def _clip_processor(model_dir: str | None, side: int):
    """CLIP's image preprocessing: the model's own config when it has one, else CLIP's defaults at ``side``."""
    from pathlib import Path

    from transformers import CLIPImageProcessor

    if model_dir and (Path(model_dir) / "preprocessor_config.json").is_file():
        return CLIPImageProcessor.from_pretrained(model_dir, local_files_only=True)
    return CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def _confined_image(records: Any, name: Any, where: str) -> Any:
    """A record's image path, relative to the records' folder and inside it (no ``..``, no absolute path)."""
    from pathlib import Path

    from loongforge.errors import RecipeError

    # NOTE: a lexical check: a symlinked image folder inside the records' folder is the user's own choice
    root = Path(records).parent
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise RecipeError(f"{where}: image '{str(name)[:200]}' is not a path inside the records' folder {root} "
                          "(relative paths only, no '..')", key="data.path")
    return root / name
