"""A Qwen-VL model's own ``data`` keys: the image side of its synthetic samples, the records' size limits."""

from __future__ import annotations

from pydantic import Field, model_validator

from loongforge_megatron.config import DataConfig


class QwenVLDataConfig(DataConfig):
    """``data`` of a Qwen-VL model: format ``conversations`` (image-text messages, ShareGPT or OpenAI style:
    ``path`` is their JSON / JSONL file) or ``synthetic``."""

    image_size: int | None = Field(None, ge=8, description="synthetic: each sample's image side (default: 4 merged "
                                   "patches)")
    max_image_pixels: int | None = Field(None, ge=1, le=2**28, description="conversations: the largest image or "
                                         "video frame read (width x height, from its header, before it is "
                                         "decoded); default 2^26 (8192 x 8192)")
    skip_unsupervised: bool | None = Field(None, description="conversations: skip (and count) records without an "
                                           "assistant turn instead of refusing them")

    @model_validator(mode="after")
    def _synthetic_image_size(self) -> QwenVLDataConfig:
        if self.image_size is not None and self.format != "synthetic":
            raise ValueError(f"data.image_size sizes the synthetic samples' images; format '{self.format}' reads "
                             "the records' own images")
        for key in ("max_image_pixels", "skip_unsupervised"):
            if getattr(self, key) is not None and self.format != "conversations":
                raise ValueError(f"data.{key} applies to format conversations, not '{self.format}'")
        return self
