"""LLaVA (CLIP vision tower + MLP projector + Llama) on megatron's LLaVAModel."""
