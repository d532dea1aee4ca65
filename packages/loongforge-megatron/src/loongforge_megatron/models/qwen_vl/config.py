"""A Qwen-VL model's own ``data`` keys: the image side of its synthetic samples."""

from __future__ import annotations

from pydantic import Field, model_validator

from loongforge_megatron.config import DataConfig


class QwenVLDataConfig(DataConfig):
    """``data`` of a Qwen-VL model: format ``conversations`` (image-text messages, ShareGPT or OpenAI style:
    ``path`` is their JSON / JSONL file) or ``synthetic``."""

    image_size: int | None = Field(None, ge=8, description="synthetic: each sample's image side (default: 4 merged "
                                   "patches)")

    @model_validator(mode="after")
    def _synthetic_image_size(self) -> QwenVLDataConfig:
        if self.image_size is not None and self.format != "synthetic":
            raise ValueError(f"data.image_size sizes the synthetic samples' images; format '{self.format}' reads "
                             "the records' own images")
        return self
