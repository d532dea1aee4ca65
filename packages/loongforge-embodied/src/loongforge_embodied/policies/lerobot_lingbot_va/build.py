"""LeRobot's ``LingBotVAConfig`` / ``WanTransformer3DModel`` of an arch, and its frozen parts.

``LingBotVAPolicy`` pulls its frozen Wan2.2 VAE, UMT5 text encoder and tokenizer lazily from
``wan_pretrained_path``; we read the same three from ``arch.wan`` (a local directory or the cached snapshot of a hub
id: nothing is downloaded), with LeRobot's own loaders.
"""

from __future__ import annotations

from loongforge_embodied.policies.lerobot_lingbot_va.configuration_lerobot_lingbot_va import (
    LATENT_CHANNELS,
    PATCH,
    PROMPT_LENGTH,
    PUBLISHED_WAN,
    LeRobotLingBotVAArch,
    hub_cache,
    local_dir,
)

WAN_FILES = ("vae/config.json", "text_encoder/config.json", "tokenizer/tokenizer_config.json")


def wan_dir(name: str) -> str:
    """The local LingBot-VA directory of ``name`` (its ``vae/``, ``text_encoder/`` and ``tokenizer/``)."""
    from loongforge.errors import RecipeError

    folder = local_dir(name, WAN_FILES)
    if folder is None:
        raise RecipeError(f"'{name}': no local folder with {', '.join(WAN_FILES)}, and no such hub id in the local "
                          f"Hugging Face cache ({hub_cache()}); download it first (e.g. `hf download {PUBLISHED_WAN} "
                          "--include 'vae/*' 'text_encoder/*' 'tokenizer/*'`) or name a local directory",
                          key="model.arch.wan")
    return folder


def transformer_kwargs(arch: LeRobotLingBotVAArch) -> dict:
    """``WanTransformer3DModel``'s arguments for ``arch`` (LeRobot's ``LingBotVAPolicy.__init__``'s)."""
    return {"patch_size": (1, PATCH, PATCH), "num_attention_heads": arch.num_heads, "attention_head_dim": arch.head_dim,
            "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS, "action_dim": arch.action_channels,
            "text_dim": arch.text_dim, "freq_dim": arch.freq_dim, "ffn_dim": arch.ffn, "num_layers": arch.num_layers,
            "cross_attn_norm": True, "eps": 1e-6, "rope_max_seq_len": 1024, "attn_mode": "torch"}


def build_transformer(arch: LeRobotLingBotVAArch):
    """LeRobot's dual-stream ``WanTransformer3DModel`` (random init, fp32; the recipe's precision autocasts)."""
    from lerobot.policies.lingbot_va.utils import WanTransformer3DModel

    return WanTransformer3DModel(**transformer_kwargs(arch))


def lingbot_config(arch: LeRobotLingBotVAArch, *, cameras: list[str] | None = None,
                   state_key: str = "observation.state", wan: str | None = None, attn_mode: str = "torch"):
    """LeRobot's ``LingBotVAConfig`` for ``arch`` (features: ``cameras``, each ``height`` x ``width``, the state
    and the action). ``wan``: what the config names (default: the arch's)."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig

    cams = cameras or [f"observation.images.cam{i}" for i in range(arch.num_cameras)]
    inputs = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, arch.height, arch.width)) for k in cams}
    inputs[state_key] = PolicyFeature(type=FeatureType.STATE, shape=(arch.state_dim,))
    identity = NormalizationMode.IDENTITY
    return LingBotVAConfig(
        patch_size=(1, PATCH, PATCH), num_attention_heads=arch.num_heads, attention_head_dim=arch.head_dim,
        action_dim=arch.action_channels, text_dim=arch.text_dim, freq_dim=arch.freq_dim, ffn_dim=arch.ffn,
        num_layers=arch.num_layers, attn_mode=attn_mode, wan_pretrained_path=wan or arch.wan, dtype="float32",
        text_encoder_device="cpu", obs_cam_keys=cams, height=arch.height, width=arch.width,
        action_per_frame=arch.action_per_frame, frame_chunk_size=arch.frame_chunk_size,
        attn_window=arch.attn_window, num_inference_steps=arch.num_steps, action_num_inference_steps=arch.action_steps,
        guidance_scale=float(arch.guidance), action_guidance_scale=float(arch.action_guidance),
        snr_shift=float(arch.video_shift), action_snr_shift=arch.action_shift_percent / 100,
        max_sequence_length=PROMPT_LENGTH, used_action_channel_ids=list(range(arch.action_dim)), device="cpu",
        normalization_mapping={"VISUAL": identity, "STATE": identity, "ACTION": identity},
        input_features=inputs,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(arch.action_dim,))},
    )


def load_frozen(arch: LeRobotLingBotVAArch) -> tuple:
    """The frozen VAE and text encoder of ``arch.wan`` (LeRobot's ``load_vae`` / ``load_text_encoder``, in
    ``arch.frozen_dtype``), checked against the arch."""
    import torch
    from lerobot.policies.lingbot_va.utils import load_text_encoder, load_vae
    from loongforge.errors import RecipeError

    folder = wan_dir(arch.wan)
    dtype = getattr(torch, arch.frozen_dtype)
    vae = load_vae(folder, torch_dtype=dtype, torch_device="cpu", subfolder="vae").eval().requires_grad_(False)
    if vae.config.z_dim != LATENT_CHANNELS:
        raise RecipeError(f"the VAE of '{arch.wan}' has {vae.config.z_dim} latent channels; LingBot-VA's Wan2.2 VAE "
                          f"has {LATENT_CHANNELS}", key="model.arch.wan")
    text_encoder = load_text_encoder(folder, torch_dtype=dtype, torch_device="cpu", subfolder="text_encoder")
    text_encoder = text_encoder.eval().requires_grad_(False)
    if text_encoder.config.d_model != arch.text_dim:
        raise RecipeError(f"text_dim {arch.text_dim} is not the width of the text encoder of '{arch.wan}' "
                          f"({text_encoder.config.d_model})", key="model.arch.text_dim")
    return vae, text_encoder
