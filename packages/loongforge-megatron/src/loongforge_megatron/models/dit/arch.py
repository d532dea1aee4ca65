"""The architecture of a class-conditional DiT (Peebles & Xie, "Scalable Diffusion Models with Transformers"), and
its translation to and from diffusers' ``DiTTransformer2DModel`` config.json.

A DiT has no parameter whose shape depends on the latent size (the 2-D position embedding is fixed sin-cos), so
``sample_size`` only fixes the patch grid a run trains on.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DIFFUSERS_CLASS = "DiTTransformer2DModel"
# NOTE: diffusers <= 0.27 saved DiT as Transformer2DModel (facebook/DiT-XL-2-256 still is); diffusers maps it to
# DiTTransformer2DModel when norm_type is ada_norm_zero.
LEGACY_CLASS = "Transformer2DModel"


class DiTArch(BaseModel):
    """DiT shape: ``num_layers`` adaLN-Zero blocks of width ``hidden_size`` over ``(sample_size / patch_size)**2``
    latent patches, conditioned on a timestep and one of ``num_classes`` classes (plus the null class)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    family: Literal["dit"] = "dit"
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=4)
    num_attention_heads: int = Field(ge=1)
    patch_size: int = Field(2, ge=1)
    sample_size: int = Field(32, ge=1, description="latent side (image side / the VAE's 8x downsampling)")
    in_channels: int = Field(4, ge=1, description="latent channels")
    learn_sigma: bool = Field(True, description="predict the variance too (out_channels = 2 * in_channels), trained with DiT's hybrid MSE + L_vlb loss")
    num_classes: int = Field(1000, ge=1)
    norm_eps: float = Field(1e-5, gt=0, description="eps of the pre-MLP LayerNorm (diffusers' norm_eps)")

    # what the backend asks every architecture
    is_dit = property(lambda self: True)
    is_moe = property(lambda self: False)
    num_experts = property(lambda self: None)
    spec_name = property(lambda self: "dit")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads

    @property
    def ffn_hidden_size(self) -> int:
        return 4 * self.hidden_size  # NOTE: diffusers' FeedForward (mult 4); DiTTransformer2DModel has no knob

    @property
    def out_channels(self) -> int:
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

    @property
    def num_patches(self) -> int:
        return (self.sample_size // self.patch_size) ** 2

    @model_validator(mode="after")
    def _check(self) -> DiTArch:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.hidden_size % 4:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of 4 (2-D sin-cos position embedding)")
        if self.sample_size % self.patch_size:
            raise ValueError(f"sample_size ({self.sample_size}) must be a multiple of patch_size ({self.patch_size})")
        return self

    def num_params(self) -> int:
        """Parameter count (the shared timestep / class embedder counted once)."""
        h, p = self.hidden_size, self.patch_size
        block = 4 * h * h + 4 * h + 2 * 4 * h * h + 5 * h + 6 * h * (h + 1)  # attention, MLP, adaLN modulation
        embed = self.in_channels * p * p * h + h + 256 * h + h + h * h + h + (self.num_classes + 1) * h
        final = 2 * h * (h + 1) + (h + 1) * p * p * self.out_channels
        return self.num_layers * block + embed + final

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per patch token: 6 x parameters + 12 x layers x hidden x tokens (full attention)."""
        return 6.0 * self.num_params() + 12.0 * self.num_layers * self.hidden_size * seq_length


def is_dit_config(cfg: dict[str, Any]) -> bool:
    """Whether an HF-style config.json is a diffusers DiT transformer."""
    cls = cfg.get("_class_name")
    return cls == DIFFUSERS_CLASS or (cls == LEGACY_CLASS and cfg.get("norm_type") == "ada_norm_zero")


def check_diffusers_config(cfg: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first field of a DiT config.json that our DiT does not implement."""
    want = {"norm_type": "ada_norm_zero", "activation_fn": "gelu-approximate", "attention_bias": True,
            "norm_elementwise_affine": False, "cross_attention_dim": None, "only_cross_attention": False,
            "double_self_attention": False, "dropout": 0.0}
    for key, value in want.items():
        if cfg.get(key, value) != value:
            raise ValueError(f"DiT config field {key}={cfg[key]!r} is not supported (supported: {value!r})")
    if cfg.get("patch_size") is None or cfg.get("num_embeds_ada_norm") is None:
        raise ValueError("DiT config needs patch_size and num_embeds_ada_norm (class-conditional, patchified)")
    out, inp = cfg.get("out_channels"), cfg.get("in_channels", 4)
    if out not in (None, inp, 2 * inp):
        raise ValueError(f"DiT config out_channels={out} is neither in_channels ({inp}) nor 2 x in_channels")


def arch_from_diffusers(cfg: dict[str, Any]) -> DiTArch:
    """A :class:`DiTArch` from a diffusers ``DiTTransformer2DModel`` (or legacy ``Transformer2DModel``) config."""
    check_diffusers_config(cfg)
    heads, head_dim = cfg.get("num_attention_heads", 16), cfg.get("attention_head_dim", 72)
    inp = cfg.get("in_channels", 4)
    return DiTArch(num_layers=cfg.get("num_layers", 28), hidden_size=heads * head_dim, num_attention_heads=heads,
                   patch_size=cfg["patch_size"], sample_size=cfg.get("sample_size", 32), in_channels=inp,
                   learn_sigma=cfg.get("out_channels") == 2 * inp, num_classes=cfg["num_embeds_ada_norm"],
                   norm_eps=cfg.get("norm_eps", 1e-5))


def diffusers_config(arch: DiTArch) -> dict[str, Any]:
    """The config.json of a diffusers ``DiTTransformer2DModel`` with ``arch``'s shape (what an export writes)."""
    return {
        "_class_name": DIFFUSERS_CLASS,
        "num_attention_heads": arch.num_attention_heads,
        "attention_head_dim": arch.head_dim,
        "in_channels": arch.in_channels,
        "out_channels": arch.out_channels,
        "num_layers": arch.num_layers,
        "dropout": 0.0,
        "norm_num_groups": 32,
        "attention_bias": True,
        "sample_size": arch.sample_size,
        "patch_size": arch.patch_size,
        "activation_fn": "gelu-approximate",
        "num_embeds_ada_norm": arch.num_classes,
        "upcast_attention": False,
        "norm_type": "ada_norm_zero",
        "norm_elementwise_affine": False,
        "norm_eps": arch.norm_eps,
    }
