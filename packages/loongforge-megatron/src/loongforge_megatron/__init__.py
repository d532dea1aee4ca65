"""loongforge_megatron."""
