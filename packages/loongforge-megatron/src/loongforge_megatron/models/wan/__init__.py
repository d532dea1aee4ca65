"""Wan2.1 / Wan2.2 video diffusion transformers (diffusers WanTransformer3DModel) on megatron-core."""
