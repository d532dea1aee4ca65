"""Qwen-Image: an MMDiT (joint text-image attention) text-to-image diffusion transformer, and its Edit variant."""
