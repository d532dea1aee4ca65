"""Qwen-VL on megatron-core: :class:`QwenVLModel` is megatron's ``GPTModel`` (the Qwen2.5 language model, with
multimodal RoPE) that also holds the vision tower on the first pipeline stage and writes its image embeddings over
the image placeholder tokens' embeddings before the decoder runs; :func:`forward_step` is its megatron step.

The language model keeps GPTModel's parameter names (``embedding.*``, ``decoder.layers.*``, ``output_layer.*``), so
the GPT name maps, the seeded initialisation and the pipeline layout are the GPT ones; the tower is ``vision.*``.
The tower is built with its component's process groups (``engine/component_groups.py``, from the plan's
``parallel.components.vision``): split over its own tp group (any divisor of the language model's tp:
``tower_parallel.py``), and when that is smaller than the language model's tp the tower's copies in one language TP
group encode different images of the micro-batch and gather the embeddings (``engine/encoder_split.py``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from loongforge_megatron.engine.step import loss_func, model_inputs
from loongforge_megatron.models.qwen_vl.data import HOST_KEYS, image_embeddings, vision_rows

VISION_PREFIXES = ("vision.",)  # the "vision" component (tower + merger)
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")  # a batch's tower inputs


def _gpt_model_class():
    from megatron.core.models.gpt import GPTModel

    class QwenVLModel(GPTModel):
        """GPTModel + the vision tower (first stage) + multimodal RoPE."""

        def __init__(self, *, vision_config: dict, image_token: int, video_token: int | None,
                     mrope_section: list[int], mrope_interleaved: bool, rotary_base: float, deepstack: bool,
                     rotary_percent: float = 1.0, vision_groups: Any = None, remote_encoder: bool = False,
                     **gpt: Any):
            from loongforge_megatron.models.qwen_vl.rope import MRoPE
            from loongforge_megatron.models.qwen_vl.vision import VisionTower
            from loongforge_megatron.models.qwen_vl.vision3 import VisionTower3

            # NOTE: the image embeddings go over the placeholders' embeddings of the whole sequence; under
            # sequence parallelism :meth:`forward` scatters the merged sequence (megatron's LLaVAModel does the same)
            super().__init__(position_embedding_type="rope", rotary_base=int(rotary_base),
                             scatter_embedding_sequence_parallel=False, **gpt)
            # NOTE: GPTModel's mrope branch calls rotary_pos_emb(position_ids, mrope_section); megatron's own
            # MultimodalRotaryEmbedding allocates on torch.cuda at build and has no interleaved sections, so the
            # model is built with plain rope and given ours
            self.position_embedding_type = "mrope"
            self.mrope_section = list(mrope_section)
            self.rotary_pos_emb = MRoPE(kv_channels=self.config.kv_channels, rotary_base=rotary_base,
                                        interleaved=mrope_interleaved, rotary_percent=rotary_percent)
            self.image_token, self.video_token = image_token, video_token
            self.merge = vision_config.get("spatial_merge_size", 2)  # merged patches: merge x merge a token
            tower = VisionTower3 if deepstack else VisionTower
            self.vision_groups, self.out_dim = vision_groups, vision_config["out_hidden_size"]
            self.vision = None
            # NOTE: remote_encoder: the tower runs on ranks of its own (engine/encoder_ranks.py), the embeddings
            # arrive through the encoder cache
            if self.pre_process and not remote_encoder:
                from loongforge_megatron.engine.encoder_split import ENCODER_ATTR, EncoderTimer

                self.vision = tower(vision_config, groups=vision_groups,
                                    recompute=getattr(vision_groups, "recompute", "none"))
                self.vision.encoder_timer = EncoderTimer()
                if vision_groups is not None:
                    vision_groups.mark_shards(self.vision)
                    if vision_groups.hdp > 1:
                        setattr(self.vision, ENCODER_ATTR, vision_groups)
            self._deepstack: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None = None
            # NOTE: under pipeline parallelism the tower's outputs are made before the schedule
            # (engine/decoupled_encoder.py): the forward reads them here, one micro-batch at a time
            self.encoder_cache, self._ahead = None, None
            self.decoupled = self.vision is not None and bool(getattr(vision_groups, "decoupled", False))
            if self.vision is not None and deepstack:
                n = len(vision_config.get("deepstack_visual_indexes", []))
                if n > len(self.decoder.layers):
                    raise ValueError(f"the {n} deepstack layers must be on the first pipeline stage, which holds "
                                     f"{len(self.decoder.layers)} layers")
                for i in range(n):
                    self.decoder.layers[i].register_forward_hook(functools.partial(self._add_deepstack, i))

        def _add_deepstack(self, i, module, args, output):
            """Deepstack: after language layer ``i``, the image tokens' hidden states get the tower's i-th
            deepstack features (transformers' ``_deepstack_process``). Under sequence parallelism the features are
            laid over the whole sequence and scattered like the embeddings, so that every tensor-parallel rank's
            tower gets the gradient of all of them (the scatter's backward gathers it)."""
            if self._deepstack is None:
                return output
            where, rows, feats, seq = self._deepstack
            hidden, *rest = output if isinstance(output, tuple) else (output,)
            add = feats[i].index_select(0, rows).to(hidden.dtype)
            if self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                width = hidden.shape[1:]
                whole = hidden.new_zeros(seq * width[0], *width[1:]).index_copy(0, where, add)
                hidden = hidden + tensor_parallel.scatter_to_sequence_parallel_region(whole.view(seq, *width))
            else:
                hidden = hidden.flatten(0, 1).index_add(0, where, add).view(hidden.shape)
            return (hidden, *rest) if isinstance(output, tuple) else hidden

        def forward(self, input_ids, position_ids, attention_mask, *, labels=None, pixel_values=None,
                    image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None, vision_index=None,
                    packed_seq_params=None, **kw):
            """Images (``pixel_values`` / ``image_grid_thw``) and videos (``pixel_values_videos`` /
            ``video_grid_thw``) as the processor makes them; ``vision_index`` ``[b, s]`` (:func:`vision_rows`,
            computed here when not given): each token's row of the tower's output, given under context parallelism,
            where this rank holds only some of the tokens."""
            decoder_input, self._deepstack = None, None
            if self.pre_process:
                self._ahead = self.encoder_cache.take() if self.encoder_cache is not None else None
                decoder_input = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
                pixels, grids, image_rows = vision_batch(pixel_values, image_grid_thw, pixel_values_videos,
                                                         video_grid_thw, merge=self.merge)
                if pixels is not None:
                    if vision_index is None:
                        vision_index = vision_rows(input_ids, self.image_token, self.video_token, images=image_rows)
                    decoder_input = self._with_images(decoder_input, vision_index, pixels, grids)
                if self.config.sequence_parallel:
                    from megatron.core import tensor_parallel

                    decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(decoder_input)
                    if self.config.clone_scatter_output_in_embedding:
                        decoder_input = decoder_input.clone()  # NOTE: the scatter returns a view (megatron's rule)
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                   labels=labels, packed_seq_params=packed_seq_params, **kw)

        def _with_images(self, emb, image_index, pixel_values, grid_thw):
            """The tower's embeddings (images', then videos') in place of the placeholder tokens' embeddings
            (``image_index`` says which embedding each token takes).

            NOTE: which tokens take which embedding is worked out on the host (the data pipeline keeps
            ``image_index`` there) and reaches the device as two index vectors, so neither this nor the deepstack
            layers read anything back from the device (a boolean-mask index would, forward and backward)."""
            feats = self._encode(pixel_values, grid_thw)
            # NOTE: hidden states are [s, b, h]: the tokens in sequence-major order
            index = image_index.cpu().t().reshape(-1)
            where = (index >= 0).nonzero().squeeze(1)
            rows = index[where]
            deep = None
            if isinstance(feats, tuple):  # Qwen3-VL: (embeddings, deepstack features)
                feats, deep = feats
            n = where.numel()
            # NOTE: a context-parallel rank holds some of the placeholders, every other rank all of them
            if (int(rows.max()) + 1 if n else 0) > feats.shape[0] or (
                    self.config.context_parallel_size == 1 and n != feats.shape[0]):
                raise ValueError(f"{n} image placeholder tokens but {feats.shape[0]} image embeddings "
                                 f"(grids {grid_thw.tolist()})")
            where, rows = where.to(emb.device, non_blocking=True), rows.to(emb.device, non_blocking=True)
            if deep is not None:
                self._deepstack = (where, rows, deep, emb.shape[0])
            flat = emb.flatten(0, 1).index_copy(0, where, feats.index_select(0, rows).to(emb.dtype))
            return flat.view(emb.shape)

        def encoder_shape(self, batch: dict[str, Any]) -> tuple[int, int] | None:
            """The embeddings the tower makes of one micro-batch's images and videos (None without any): an
            encoder on ranks of its own sends them (``engine/encoder_ranks.py``)."""
            rows = encoder_rows(batch, merge=self.merge)
            return None if rows is None else (rows, self.out_dim)

        def encode_ahead(self, batch: dict[str, Any]) -> Any:
            """The tower's output for one micro-batch's images and videos (None without any), for the decoupled
            encoder."""
            device = next(self.vision.parameters()).device
            pixels, grids, _ = vision_batch(*(batch.get(k) for k in VISION_KEYS), merge=self.merge)
            if pixels is None:
                return None
            return self._encode(pixels.to(device), grids)

        def _encode(self, pixel_values, grid_thw):
            """The tower's output for every image: made ahead (the decoupled encoder), run here whole, or (encoder
            hetero-DP) this copy's share of the images, shared by patch count, then every copy's embeddings gathered
            in image order."""
            from loongforge_megatron.engine.encoder_split import gather_rows, share_images, timed

            if self._ahead is not None:
                ahead, self._ahead = self._ahead, None
                return ahead
            groups, timer, grid = self.vision_groups, self.vision.encoder_timer, grid_thw.cpu()
            if groups is None or groups.hdp == 1:
                return timed(self.vision, timer, grid.shape[0], pixel_values, grid_thw)
            patches = grid.prod(-1).tolist()
            shares = share_images(patches, groups.hdp)
            mine, unit = shares[groups.hdp_rank], self.merge * self.merge
            starts = [0]
            for n in patches:
                starts.append(starts[-1] + n)
            deep = len(getattr(self.vision, "deepstack", ()))
            if mine:
                rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in mine])
                out = timed(self.vision, timer, len(mine), pixel_values.index_select(0, rows.to(pixel_values.device)),
                            grid[mine])
            else:
                # NOTE: fewer images than copies: this copy encodes none and still takes part in the gathers; its
                # (empty) rows require a gradient when the tower trains, so that every copy's autograd graph holds
                # the same collectives downstream (a sequence-parallel scatter of the deepstack features)
                trains = any(p.requires_grad for p in self.vision.parameters())
                dtype = next(self.vision.parameters()).dtype
                empty = torch.zeros(0, self.out_dim, dtype=dtype, device=pixel_values.device, requires_grad=trains)
                out = (empty, [empty] * deep) if deep else empty
            gather = functools.partial(gather_rows, rows_of=[n // unit for n in patches], shares=shares,
                                       group=groups.hdp_group)
            if isinstance(out, tuple):
                return gather(out[0]), [gather(f) for f in out[1]]
            return gather(out)

    return QwenVLModel


def encoder_rows(batch: dict[str, Any], *, merge: int) -> int | None:
    """The tower's output rows for one micro-batch (one per merged patch; None without images or videos)."""
    _, grids, _ = vision_batch(*(batch.get(k) for k in VISION_KEYS), merge=merge)
    return None if grids is None else int(grids.prod(-1).sum()) // (merge * merge)


class QwenVLEncoder(torch.nn.Module):
    """The vision tower alone, for ranks that only encode (``parallel.components.vision.num_ranks``): ``vision.*``
    as in :class:`QwenVLModel`, so the name maps and checkpoints are the model's; :meth:`encode` makes one
    micro-batch's embeddings."""

    def __init__(self, *, vision_config: dict, config: Any, recompute: str = "none"):
        from loongforge_megatron.engine.encoder_split import EncoderTimer
        from loongforge_megatron.models.qwen_vl.vision import VisionTower

        super().__init__()
        self.config, self.pre_process = config, True
        self.merge = vision_config.get("spatial_merge_size", 2)
        self.vision = VisionTower(vision_config, recompute=recompute)
        self.vision.encoder_timer = EncoderTimer()

    def encode(self, batch: dict[str, Any]) -> torch.Tensor | None:
        from loongforge_megatron.engine.encoder_split import timed

        device = next(self.vision.parameters()).device
        pixels, grids, _ = vision_batch(*(batch.get(k) for k in VISION_KEYS), merge=self.merge)
        if pixels is None:
            return None
        return timed(self.vision, self.vision.encoder_timer, grids.shape[0], pixels.to(device), grids)


def vision_batch(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, *, merge: int):
    """(the tower's input: the images' patches then the videos', their grids, how many embeddings the images
    make) — (None, None, 0) without either. The tower treats every grid on its own, so one call serves both."""
    parts = [(p, g) for p, g in ((pixel_values, image_grid_thw), (pixel_values_videos, video_grid_thw))
             if p is not None and p.numel()]
    if not parts:
        return None, None, 0
    images = image_embeddings(pixel_values, image_grid_thw, merge=merge)
    if len(parts) == 1:
        return parts[0][0], parts[0][1], images
    return (torch.cat([pixel_values, pixel_values_videos.to(pixel_values.dtype)]),
            torch.cat([image_grid_thw, video_grid_thw]), images)


def build_qwen_vl(*, config: Any, arch: Any, layer_spec: Any, vocab_size: int, max_sequence_length: int,
                  device: torch.device, vpp: int = 1, vision_groups: Any = None,
                  remote_encoder: bool = False) -> list[torch.nn.Module]:
    """This rank's chunks (one per virtual pipeline stage), before DDP; the tower lives on the first stage, laid
    out by ``vision_groups`` (:func:`~loongforge_megatron.engine.component_groups.component_groups`; None: whole,
    each TP rank encoding every image), or on ranks of its own (``remote_encoder``: none here)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage

    from loongforge_megatron.engine.model import _block_spec, _not_deprecation_notice

    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_not_deprecation_notice)
    cls = _gpt_model_class()
    v = arch.vision
    vp_size = vpp if vpp > 1 else None
    chunks = []
    for i in range(vpp):
        vp_stage = i if vpp > 1 else None
        model = cls(
            vision_config=v["vision_config"], image_token=v["image_token_id"], video_token=v.get("video_token_id"),
            mrope_section=v["mrope_section"], mrope_interleaved=v.get("mrope_interleaved", False),
            deepstack="deepstack_visual_indexes" in v["vision_config"],
            rotary_base=arch.rope_theta, rotary_percent=arch.rotary_percent, config=config, vision_groups=vision_groups,
            remote_encoder=remote_encoder,
            transformer_layer_spec=_block_spec(config, layer_spec, vp_stage), vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=True) and is_vp_first_stage(vp_stage, vp_size),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=True) and is_vp_last_stage(vp_stage, vp_size),
            share_embeddings_and_output_weights=arch.tie_embeddings, vp_stage=vp_stage)
        if model.vision is not None:
            model.vision.to(dtype=config.params_dtype)
        model.to(device)
        chunks.append(model)
    return chunks


def forward_step(data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module, *,
                 output_processor: Callable[..., torch.Tensor] | None = None):
    """megatron's ``forward_step_func`` for :class:`QwenVLModel`: ``position_ids`` ``[b, 3, s]`` (multimodal),
    the micro-batch's images and videos as the processor's patches (``pixel_values``, ``image_grid_thw``,
    ``pixel_values_videos``, ``video_grid_thw``); a packed
    micro-batch (``[1, t]``, ``packed_seq_params``) as :func:`~loongforge_megatron.engine.step.model_inputs` gives it.
    ``output_processor``: GPTModel's output hook, given the loss mask (the loongforge spec's fused linear
    cross-entropy, :func:`~loongforge_megatron.layers.output.fused_output_processor`); None: the output layer's
    logits and megatron's cross-entropy."""
    from loongforge_megatron.engine.model import unwrap

    batch, inner = next(data_iterator), unwrap(model)
    vision = {k: batch.get(k) for k in VISION_KEYS}
    if inner.pre_process and batch.get("vision_index") is None and any(
            v is not None and v.numel() for v in vision.values()):
        # NOTE: from the whole sequence, before a context-parallel rank keeps its part of it (the data pipeline
        # gives it, made on the host: this reads the tokens back from the device)
        images = image_embeddings(vision["pixel_values"], vision["image_grid_thw"], merge=inner.merge)
        batch["vision_index"] = vision_rows(batch["tokens"], inner.image_token, inner.video_token, images=images)
    batch = model_inputs(batch, model, seq_keys=("vision_index",), host_keys=HOST_KEYS)
    fused = {} if output_processor is None else {"output_processor": output_processor,
                                                 "output_processor_context": batch["loss_mask"]}
    output = model(batch["tokens"], batch["position_ids"].transpose(0, 1).contiguous(), batch.get("attention_mask"),
                   labels=batch["labels"], **{k: batch.get(k) for k in vision}, vision_index=batch.get("vision_index"),
                   packed_seq_params=batch.get("packed_seq_params"), **fused)
    return output, functools.partial(loss_func, batch["loss_mask"])
