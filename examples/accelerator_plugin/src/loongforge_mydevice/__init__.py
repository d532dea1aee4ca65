"""Example LoongForge plugin package: accelerator ``mydevice`` and backend ``toy``."""
