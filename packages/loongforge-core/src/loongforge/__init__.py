"""LoongForge core."""
