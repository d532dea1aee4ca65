"""LeRobot's ``GR00TN17Config`` / ``GR00TN17`` of an arch, and the ``GrootConfig`` an export is loaded with.

LeRobot builds the backbone from its Hugging Face directory (``AutoConfig.from_pretrained(model_name)``, and the
Qwen3-VL processor from the same folder): we hand it the local folder (or cached snapshot) of ``arch.vlm``, so
nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

from loongforge_embodied.policies.lerobot_groot.configuration_lerobot_groot import LeRobotGrootArch, local_vlm


def model_config(arch: LeRobotGrootArch, *, vlm: str | None = None):
    """LeRobot's ``GR00TN17Config`` for ``arch`` (fp32 parameters: the trainer's precision casts)."""
    from lerobot.policies.groot.groot_n1_7 import GR00TN17Config

    dropout = arch.dropout_percent / 100
    return GR00TN17Config(
        model_name=vlm or local_vlm(arch.vlm) or arch.vlm, select_layer=arch.select_layer,
        backbone_embedding_dim=arch.backbone_embedding_dim, hidden_size=arch.hidden_size,
        input_embedding_dim=arch.input_embedding_dim, max_state_dim=arch.max_state_dim,
        max_action_dim=arch.max_action_dim, action_horizon=arch.chunk_size, max_num_embodiments=arch.num_embodiments,
        diffusion_model_cfg={"positional_embeddings": None, "num_layers": arch.dit_layers,
                             "num_attention_heads": arch.dit_heads, "attention_head_dim": arch.dit_head_dim,
                             "norm_type": "ada_norm", "dropout": dropout, "final_dropout": True,
                             "output_dim": arch.hidden_size, "interleave_self_attention": True},
        vl_self_attention_cfg={"positional_embeddings": None, "num_layers": arch.vl_layers,
                               "num_attention_heads": arch.vl_heads, "attention_head_dim": arch.vl_head_dim,
                               "dropout": dropout, "final_dropout": True},
        attn_dropout=dropout, state_dropout_prob=arch.state_dropout_percent / 100,
        num_inference_timesteps=arch.num_steps, image_crop_size=[arch.image_crop_size] * 2,
        image_target_size=[arch.image_target_size] * 2, model_dtype="float32", dtype="float32",
        # NOTE: what trains is the recipe's model.freeze; LeRobot's tune_* flags would freeze parts behind its back
        tune_llm=True, tune_visual=True, tune_top_llm_layers=0)


def build_groot(arch: LeRobotGrootArch):
    """LeRobot's ``GR00TN17`` (random init unless ``load_vlm_weights``) and its ``GR00TN17Config``."""
    from loongforge.errors import require_module

    # NOTE: every path to the model (train, serve, eval, an export's load) builds it here; without diffusers
    # LeRobot's action head raises a bare ImportError naming LeRobot's pip extra, not ours
    require_module("diffusers", extra="loongforge-embodied[groot]",
                   what="model.policy lerobot_groot (LeRobot's GR00T N1.7 action head)")
    from lerobot.policies.groot.groot_n1_7 import GR00TN17, _tie_unused_qwen_lm_head

    config = model_config(arch)
    model = GR00TN17(config, load_backbone_weights=bool(arch.load_vlm_weights))
    _tie_unused_qwen_lm_head(model.backbone.model)  # NOTE: as GrootPolicy does: the unused LM head is the embeddings
    for p in model.parameters():
        p.requires_grad_(True)
    # NOTE: the action head reads the last kept text layer's output before the final norm: that norm cannot reach
    # the loss (a parameter without a gradient, which DDP refuses), so it stays frozen
    model.backbone.language_model.norm.requires_grad_(False)
    return model, config


def policy_config(arch: LeRobotGrootArch, *, base: str, cameras: list[str] | None = None,
                  state_key: str = "observation.state") -> Any:
    """LeRobot's ``GrootConfig`` (type ``groot``) of ``arch``: ``base`` is the GR00T N1.7 model directory
    ``GrootPolicy`` builds its network from (``base_model_path``)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.groot.configuration_groot import GrootConfig

    cams = cameras or [f"observation.images.cam{i}" for i in range(arch.num_cameras)]
    inputs = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, arch.image_size, arch.image_size)) for k in cams}
    inputs[state_key] = PolicyFeature(type=FeatureType.STATE, shape=(arch.state_dim,))
    return GrootConfig(
        base_model_path=base, chunk_size=arch.chunk_size, n_action_steps=arch.chunk_size,
        max_state_dim=arch.max_state_dim, max_action_dim=arch.max_action_dim, num_inference_timesteps=arch.num_steps,
        tune_llm=True, tune_visual=True, use_bf16=False, device="cpu", input_features=inputs,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(arch.action_dim,))})
