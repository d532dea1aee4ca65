"""The architecture of Qwen-Image's diffusion transformer (an MMDiT: text and image streams with their own
projections and norms, one attention over both), its published size, and its translation to and from diffusers'
``QwenImageTransformer2DModel`` config.json.

The transformer reads packed latent patches (``in_channels`` = latent channels x patch x patch: 16 x 2 x 2 = 64)
and the text encoder's (Qwen2.5-VL) last hidden states (``joint_attention_dim`` wide). Qwen-Image-Edit is the same
transformer: the reference image's packed patches follow the noisy image's in the token sequence (with
``zero_cond_t``, as Qwen-Image-Edit-2511, they are modulated by the timestep 0).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DIFFUSERS_CLASS = "QwenImageTransformer2DModel"
TIME_FEATURES = 256  # NOTE: diffusers' QwenTimestepProjEmbeddings fixes the sinusoidal features' width
ROPE_THETA = 10000.0
NORM_EPS = 1e-6  # NOTE: diffusers fixes every norm's epsilon of this model (no config key)
#: config.json keys of variants our transformer does not build, with the value it does
UNSUPPORTED = {"guidance_embeds": False, "use_additional_t_cond": False, "use_layer3d_rope": False}


class QwenImageArch(BaseModel):
    """Qwen-Image shape: ``num_layers`` dual-stream blocks of width ``hidden_size`` (image and text each with their
    own timestep modulation, LayerNorms, q / k / v, per-head q / k RMSNorm, output projection and GELU-tanh MLP of
    ``ffn_hidden_size`` = 4 x hidden; one attention over text + image tokens with a 3-axis RoPE)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    family: Literal["qwen_image"] = "qwen_image"
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=2)
    num_attention_heads: int = Field(ge=1)
    ffn_hidden_size: int = Field(ge=1, description="the MLPs' width (diffusers: 4 x hidden_size)")
    patch_size: int = Field(2, ge=1, description="latent pixels per patch side (the pipeline packs 2 x 2)")
    in_channels: int = Field(64, ge=1, description="packed patch channels (16 latent channels x 2 x 2)")
    out_channels: int = Field(16, ge=1, description="predicted velocity channels per latent pixel")
    joint_attention_dim: int = Field(3584, ge=1, description="width of the text encoder's hidden states "
                                     "(Qwen2.5-VL-7B: 3584)")
    axes_dims_rope: tuple[int, int, int] = Field((16, 56, 56), description="head channels RoPE gives to frame "
                                                 "(image index), rows and columns")
    zero_cond_t: bool = Field(False, description="reference-image tokens are modulated by timestep 0 "
                              "(Qwen-Image-Edit-2511)")
    norm_eps: float = Field(NORM_EPS, gt=0)

    # what the backend asks every architecture
    is_moe = property(lambda self: False)
    num_experts = property(lambda self: None)
    spec_name = property(lambda self: "qwen_image")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads

    @model_validator(mode="after")
    def _check(self) -> QwenImageArch:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.ffn_hidden_size != 4 * self.hidden_size:
            raise ValueError(f"ffn_hidden_size ({self.ffn_hidden_size}) must be 4 x hidden_size "
                             f"({4 * self.hidden_size}): diffusers' Qwen-Image MLPs are 4 x wide")
        if sum(self.axes_dims_rope) != self.head_dim or any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {list(self.axes_dims_rope)} must be even and sum to the head size "
                             f"{self.head_dim}")
        if self.norm_eps != NORM_EPS:
            raise ValueError(f"norm_eps must be {NORM_EPS} (diffusers' Qwen-Image fixes it)")
        return self

    def tokens(self, height: int, width: int) -> int:
        """Patch tokens of one latent image of ``height x width``."""
        return (height // self.patch_size) * (width // self.patch_size)

    def num_params(self) -> int:
        """Parameter count (as diffusers' model holds it)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        mlp = h * f + f + f * h + h
        block = 2 * (6 * h * h + 6 * h) + 8 * (h * h + h) + 4 * d + 2 * mlp
        embed = self.in_channels * h + h + self.joint_attention_dim * (h + 1) + h
        embed += TIME_FEATURES * h + h + h * h + h
        final = 2 * h * h + 2 * h + h * self.patch_size**2 * self.out_channels + self.patch_size**2 * self.out_channels
        return self.num_layers * block + embed + final

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token: 6 x parameters + 12 x layers x hidden x tokens (joint attention)."""
        return 6.0 * self.num_params() + 12.0 * self.num_layers * self.hidden_size * seq_length


def check_diffusers_config(cfg: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first field of a Qwen-Image config.json our transformer does not build."""
    for key, value in UNSUPPORTED.items():
        if cfg.get(key, value) != value:
            raise ValueError(f"Qwen-Image config field {key}={cfg[key]!r} is not supported (supported: {value!r})")


def arch_from_diffusers(cfg: dict[str, Any]) -> QwenImageArch:
    """A :class:`QwenImageArch` from a diffusers ``QwenImageTransformer2DModel`` config (its defaults where
    absent)."""
    check_diffusers_config(cfg)
    heads, head_dim = cfg.get("num_attention_heads", 24), cfg.get("attention_head_dim", 128)
    inp = cfg.get("in_channels", 64)
    return QwenImageArch(num_layers=cfg.get("num_layers", 60), hidden_size=heads * head_dim,
                         num_attention_heads=heads, ffn_hidden_size=4 * heads * head_dim,
                         patch_size=cfg.get("patch_size", 2), in_channels=inp,
                         out_channels=cfg.get("out_channels", 16) or inp,
                         joint_attention_dim=cfg.get("joint_attention_dim", 3584),
                         axes_dims_rope=tuple(cfg.get("axes_dims_rope", (16, 56, 56))),
                         zero_cond_t=cfg.get("zero_cond_t", False))


def diffusers_config(arch: QwenImageArch) -> dict[str, Any]:
    """The config.json of a diffusers ``QwenImageTransformer2DModel`` with ``arch``'s shape (what an export
    writes)."""
    return {
        "_class_name": DIFFUSERS_CLASS,
        "patch_size": arch.patch_size,
        "in_channels": arch.in_channels,
        "out_channels": arch.out_channels,
        "num_layers": arch.num_layers,
        "attention_head_dim": arch.head_dim,
        "num_attention_heads": arch.num_attention_heads,
        "joint_attention_dim": arch.joint_attention_dim,
        "axes_dims_rope": list(arch.axes_dims_rope),
        "zero_cond_t": arch.zero_cond_t,
        **UNSUPPORTED,
    }


PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen-Image (transformer/config.json); Qwen/Qwen-Image-Edit and -Edit-2509 share it
    "qwen-image-20b": dict(family="qwen_image", num_layers=60, hidden_size=3072, num_attention_heads=24,
                           ffn_hidden_size=12288),
    "qwen-image-tiny": dict(family="qwen_image", num_layers=2, hidden_size=64, num_attention_heads=4,
                            ffn_hidden_size=256, in_channels=16, out_channels=4, joint_attention_dim=32,
                            axes_dims_rope=(4, 6, 6)),
}
