"""LoongForge accelerator plugin ``kunlun`` (Baidu Kunlun XPU). Importing it never imports the Kunlun runtime."""

from __future__ import annotations

from loongforge_xpu.accelerator import KunlunAccelerator

__all__ = ["KunlunAccelerator"]
