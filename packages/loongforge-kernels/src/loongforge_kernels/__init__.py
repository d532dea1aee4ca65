"""loongforge_kernels."""
