"""DiT: class-conditional latent diffusion transformers (diffusers DiTTransformer2DModel checkpoints)."""
