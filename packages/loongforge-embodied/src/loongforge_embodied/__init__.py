"""loongforge_embodied."""
