"""loongforge_xpu."""
