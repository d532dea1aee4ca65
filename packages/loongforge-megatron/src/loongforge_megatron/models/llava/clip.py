"""The adaptation megatron-core's LLaVA build needs without TransformerEngine: CLIP's norms, and on the CPU its
position ids.

``LLaVAModel`` builds its CLIP tower as ``CLIPViTModel(...)`` with ln_pre / ln_post left at their default, which
without TransformerEngine is ``torch.nn.LayerNorm``: it rejects megatron's ``config=`` argument, and LLaVAModel
cannot pass another. The adaptation replaces the name ``CLIPViTModel`` in ``llava_model`` (where LLaVAModel looks it
up) by a builder that passes megatron's ``WrappedTorchNorm``; on the CPU the builder also runs CLIP's ``__init__``
with ``tensor.cuda()`` as the identity (it moves its position ids to CUDA), in this thread only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from loongforge.accelerator.adaptation import Adaptation, replace_attr

NAME = "llava-clip-torch-norms"
TARGET = "megatron.core.models.multimodal.llava_model.CLIPViTModel"
MARK = "_loongforge_clip_builder"


def _builder(original: type, *, cpu: bool) -> Callable[..., Any]:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from loongforge_megatron.device_adapters.cpu_torch import cuda_copy_as_identity

    @functools.wraps(original, updated=())
    def clip_vit_model(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("ln_pre_impl", WrappedTorchNorm)
        kwargs.setdefault("ln_post_impl", WrappedTorchNorm)
        with cuda_copy_as_identity() if cpu else contextlib.nullcontext():
            return original(*args, **kwargs)

    setattr(clip_vit_model, MARK, True)
    return clip_vit_model


def _expect(original: Any) -> bool:
    import inspect

    from megatron.core.models.multimodal import llava_model

    if not isinstance(original, type):
        return False
    init = inspect.getsource(original.__init__)
    return "ln_pre_impl" in init and "ln_post_impl" in init and ".cuda()" in init \
        and "CLIPViTModel(" in inspect.getsource(llava_model.LLaVAModel.__init__)


def clip_adaptations(*, cpu: bool) -> list[Adaptation]:
    """The LLaVA build's adaptation (for the run of a LLaVA recipe; ``cpu``: also CLIP's ``.cuda()`` as identity)."""
    return [replace_attr(NAME, TARGET, functools.partial(_builder, cpu=cpu), expect=_expect,
                         description="LLaVA's CLIP tower built with WrappedTorchNorm ln_pre / ln_post (no TE)"
                                     + (" and CPU position ids" if cpu else ""))]


def clip_builder() -> Callable[..., Any]:
    """``llava_model.CLIPViTModel`` as adapted; a clear error when the run did not apply :func:`clip_adaptations`."""
    from megatron.core.models.multimodal import llava_model

    built = llava_model.CLIPViTModel
    if not getattr(built, MARK, False):
        raise RuntimeError(f"building LLaVA needs the '{NAME}' adaptation: apply "
                           "loongforge_megatron.models.llava.clip.clip_adaptations(...) for the run")
    return built
