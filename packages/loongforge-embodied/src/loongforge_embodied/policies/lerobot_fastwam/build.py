"""LeRobot's ``FastWAMConfig`` / ``FastWAM`` of an arch.

``FastWAMPolicy._build_core_model`` loads the frozen Wan2.2 VAE from its hub id and the UMT5 text encoder from
``text_encoder_model_id``; we build the same ``FastWAM`` with both read from ``arch.wan`` (a local directory or the
cached snapshot of a hub id: nothing is downloaded), and the tokenizer from ``arch.tokenizer``.
"""

from __future__ import annotations

import functools

from loongforge_embodied.policies.lerobot_fastwam.configuration_lerobot_fastwam import (
    LATENT_CHANNELS,
    PATCH,
    PUBLISHED_WAN,
    LeRobotFastWAMArch,
    hub_cache,
    local_dir,
)

WAN_FILES = ("vae/config.json", "text_encoder/config.json")
TOKENIZER_FILES = ("tokenizer_config.json",)


def wan_dir(name: str) -> str:
    """The local Wan2.2 diffusers directory of ``name`` (its ``vae/`` and ``text_encoder/``)."""
    from loongforge.errors import RecipeError

    folder = local_dir(name, WAN_FILES)
    if folder is None:
        raise RecipeError(f"'{name}': no local folder with {' and '.join(WAN_FILES)}, and no such hub id in the local "
                          f"Hugging Face cache ({hub_cache()}); download it first (e.g. `hf download {PUBLISHED_WAN} "
                          "--include 'vae/*' 'text_encoder/*'`) or name a local directory", key="model.arch.wan")
    return folder


@functools.cache
def tokenizer_dir(name: str) -> str:
    """The local tokenizer directory of ``name``."""
    from loongforge.errors import RecipeError

    folder = local_dir(name, TOKENIZER_FILES)
    if folder is None:
        raise RecipeError(f"'{name}': no local folder with {TOKENIZER_FILES[0]}, and no such hub id in the local "
                          f"Hugging Face cache ({hub_cache()}); download it first or name a local tokenizer directory",
                          key="model.arch.tokenizer")
    return folder


def dit_configs(arch: LeRobotFastWAMArch) -> tuple[dict, dict]:
    """LeRobot's ``video_dit_config`` / ``action_dit_config`` dicts of ``arch``."""
    width = arch.num_heads * arch.head_dim
    video = {"patch_size": [1, PATCH, PATCH], "in_dim": LATENT_CHANNELS, "hidden_dim": width,
             "ffn_dim": arch.video_ffn, "freq_dim": arch.freq_dim, "text_dim": arch.text_dim,
             "out_dim": LATENT_CHANNELS, "num_heads": arch.num_heads, "attn_head_dim": arch.head_dim,
             "num_layers": arch.num_layers, "eps": 1e-6, "seperated_timestep": True,
             "use_gradient_checkpointing": False, "video_attention_mask_mode": arch.video_mask,
             "action_conditioned": False, "action_dim": arch.action_dim,
             "action_group_causal_mask_mode": "group_diagonal", "fp32_attention": True}
    action = {"action_dim": arch.action_dim, "hidden_dim": arch.action_hidden, "ffn_dim": arch.action_ffn,
              "num_heads": arch.num_heads, "attn_head_dim": arch.head_dim, "num_layers": arch.num_layers,
              "text_dim": arch.text_dim, "freq_dim": arch.freq_dim, "eps": 1e-6, "use_gradient_checkpointing": False,
              "fp32_attention": True}
    return video, action


def fastwam_config(arch: LeRobotFastWAMArch, *, cameras: list[str] | None = None,
                   state_key: str = "observation.state", wan: str | None = None, tokenizer: str | None = None):
    """LeRobot's ``FastWAMConfig`` for ``arch`` (features: ``cameras``, each ``height`` x ``width / cameras``, the
    state and the action). ``wan`` / ``tokenizer``: what the config names (default: the arch's)."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.fastwam.configuration_fastwam import FastWAMConfig

    cams = cameras or [f"observation.images.cam{i}" for i in range(arch.num_cameras)]
    per_cam = (3, arch.height, arch.width // len(cams))
    inputs = {k: PolicyFeature(type=FeatureType.VISUAL, shape=per_cam) for k in cams}
    if arch.proprio:
        inputs[state_key] = PolicyFeature(type=FeatureType.STATE, shape=(arch.state_dim,))
    mode = NormalizationMode.MEAN_STD if arch.normalization == "mean_std" else NormalizationMode.IDENTITY
    video, action = dit_configs(arch)
    return FastWAMConfig(
        action_dim=arch.action_dim, proprio_dim=arch.state_dim if arch.proprio else None,
        action_horizon=arch.chunk_size, n_action_steps=arch.chunk_size, num_video_frames=arch.video_frames,
        action_video_freq_ratio=arch.frame_stride, image_size=(arch.height, arch.width),
        context_len=arch.tokenizer_max_length, tokenizer_max_len=arch.tokenizer_max_length,
        tokenizer_model_id=tokenizer or arch.tokenizer, text_encoder_model_id=wan or arch.wan,
        # NOTE: no base checkpoint is looked up: the weights are ours (LeRobot would point published sizes at
        # lerobot/fastwam_base)
        base_model_id=None, torch_dtype="float32", num_inference_steps=arch.num_steps,
        video_scheduler={"train_shift": float(arch.video_shift), "infer_shift": float(arch.video_shift),
                         "num_train_timesteps": 1000},
        action_scheduler={"train_shift": float(arch.action_shift), "infer_shift": float(arch.action_shift),
                          "num_train_timesteps": 1000},
        loss={"lambda_video": arch.video_loss_percent / 100, "lambda_action": 1.0},
        video_dit_config=video, action_dit_config=action, device="cpu",
        normalization_mapping={"VISUAL": NormalizationMode.IDENTITY, "STATE": mode, "ACTION": mode},
        input_features=inputs,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(arch.action_dim,))},
    )


def build_fastwam(arch: LeRobotFastWAMArch):
    """LeRobot's ``FastWAM`` (random init of the trainable experts; the frozen VAE and text encoder loaded from
    ``arch.wan``), as ``FastWAMPolicy._build_core_model`` builds it, and its ``FastWAMConfig``."""
    import torch
    from diffusers import AutoencoderKLWan
    from lerobot.policies.fastwam.wan import ActionDiT, FastWAM, MoT, WanVideoDiT, WanVideoVAE38
    from lerobot.policies.fastwam.wan.components import build_wan_tokenizer, load_pretrained_wan_text_encoder
    from loongforge.errors import RecipeError

    folder = wan_dir(arch.wan)
    config = fastwam_config(arch, wan=folder, tokenizer=tokenizer_dir(arch.tokenizer))
    dtype, device = torch.float32, "cpu"
    video_expert = WanVideoDiT(**config.video_dit_config)
    action_expert = ActionDiT(**config.action_dit_config)
    mot = MoT(mixtures={"video": video_expert, "action": action_expert},
              mot_checkpoint_mixed_attn=config.mot_checkpoint_mixed_attn)
    # NOTE: only the frozen parts take arch.frozen_dtype; the experts train in fp32 (the recipe's precision autocasts)
    frozen = getattr(torch, arch.frozen_dtype)
    text_encoder = load_pretrained_wan_text_encoder(model_id=folder, torch_dtype=frozen, device=device)
    if text_encoder.dim != arch.text_dim:
        raise RecipeError(f"text_dim {arch.text_dim} is not the width of the text encoder of '{arch.wan}' "
                          f"({text_encoder.dim})", key="model.arch.text_dim")
    vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=frozen)
    if vae.config.z_dim != LATENT_CHANNELS:
        raise RecipeError(f"the VAE of '{arch.wan}' has {vae.config.z_dim} latent channels; FastWAM's Wan2.2 VAE has "
                          f"{LATENT_CHANNELS}", key="model.arch.wan")
    model = FastWAM(
        video_expert=video_expert, action_expert=action_expert, mot=mot,
        vae=WanVideoVAE38(dtype=frozen, device=device, pretrained=vae), text_encoder=text_encoder,
        tokenizer=build_wan_tokenizer(model_id=config.tokenizer_model_id, tokenizer_max_len=config.tokenizer_max_len),
        text_dim=arch.text_dim, proprio_dim=config.proprio_dim, device=device, torch_dtype=dtype,
        video_train_shift=float(arch.video_shift), video_infer_shift=float(arch.video_shift),
        video_num_train_timesteps=1000, action_train_shift=float(arch.action_shift),
        action_infer_shift=float(arch.action_shift), action_num_train_timesteps=1000,
        loss_lambda_video=arch.video_loss_percent / 100, loss_lambda_action=1.0,
    )
    return model, config
