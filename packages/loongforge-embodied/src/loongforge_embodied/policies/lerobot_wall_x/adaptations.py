"""LeRobot 0.6.1's Wall-X under the installed transformers, as named, checked, reversible adaptations
(``loongforge.accelerator.adaptation``) that a run applies (the model module's ``adaptations()``).

LeRobot 0.6.1 pins transformers < 5.6; from 5.6 on ``create_causal_mask`` takes ``cache=`` and no
``cache_position=``, and a model output's ``past_key_values=`` is renamed ``cache=`` on the way in. Wall-X's text
model still calls the mask builders with the old keywords (every forward: training and sampling) and
``train_step_forward`` returns its output dataclass with ``past_key_values=`` (LeRobot's own training step).
Each adaptation is ``None`` where the installed transformers still takes the old form. LeRobot's own
``WallXPolicy`` in the same process gets them too (what comparing with it, or loading an export with it, needs:
``with adapted(): ...``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

from loongforge.accelerator.adaptation import Adaptation, AdaptationSet, replace_attr

MOE = "lerobot.policies.wall_x.qwen_model.qwen2_5_vl_moe"
MODELING = "lerobot.policies.wall_x.modeling_wall_x"
MASKS = ("create_causal_mask", "create_sliding_window_causal_mask")
OUTPUT = "Qwen2_5_VLACausalLMOutputWithPast"


def _mask_with_new_kwargs(original: Callable, *args: Any, cache_position: Any = None, past_key_values: Any = None,
                          **kwargs: Any):
    """LeRobot's ``create_*_mask(cache_position=…, past_key_values=…)`` call in the signature of transformers >= 5.6
    (``cache=…``; the cache position is derived from the cache)."""
    return original(*args, cache=past_key_values, **kwargs)


def _calls_old_kwargs() -> bool:
    from lerobot.policies.wall_x.qwen_model.qwen2_5_vl_moe import Qwen2_5_VLMoEModel

    source = inspect.getsource(Qwen2_5_VLMoEModel.forward)
    return '"cache_position": cache_position' in source and '"past_key_values": past_key_values' in source


def _mask_adaptation(name: str) -> Adaptation | None:
    from transformers import masking_utils

    params = inspect.signature(getattr(masking_utils, name)).parameters
    if "cache_position" in params or "cache" not in params:
        return None
    return replace_attr(
        f"wall-x-{name.replace('_', '-')}", f"{MOE}.{name}",
        lambda original: functools.partial(_mask_with_new_kwargs, original),
        description=f"LeRobot's Wall-X {name} call (cache_position=, past_key_values=) in transformers >= 5.6's "
                    "keywords (cache=)",
        expect=lambda original: original is getattr(masking_utils, name) and _calls_old_kwargs())


def _output_with_cache(original: type) -> type:
    """``original`` (a ``ModelOutput`` dataclass with ``past_key_values``) with the ``cache`` field the installed
    transformers renames ``past_key_values=`` to."""
    return dataclasses.make_dataclass(original.__name__, [("cache", Any, dataclasses.field(default=None))],
                                      bases=(original,))


def _output_adaptation() -> Adaptation | None:
    from lerobot.policies.wall_x.qwen_model import qwen2_5_vl_moe

    fields = {f.name for f in dataclasses.fields(qwen2_5_vl_moe.Qwen2_5_VLACausalLMOutputWithPast)}
    try:
        qwen2_5_vl_moe.Qwen2_5_VLACausalLMOutputWithPast(past_key_values=None)
        return None
    except TypeError:
        pass
    return replace_attr(
        "wall-x-output-cache", f"{MODELING}.{OUTPUT}", _output_with_cache,
        description="LeRobot's Wall-X training output (past_key_values=) with the cache= field transformers >= 5.6 "
                    "renames it to",
        expect=lambda original: "past_key_values" in fields and "cache" not in fields
        and original is qwen2_5_vl_moe.Qwen2_5_VLACausalLMOutputWithPast)


def adaptations() -> list[Adaptation]:
    """The adaptations the installed transformers needs (empty under LeRobot 0.6.1's own range)."""
    found = (*(_mask_adaptation(n) for n in MASKS), _output_adaptation())
    return [a for a in found if a is not None]


def adapted() -> AdaptationSet:
    """``with adapted(): ...``: :func:`adaptations` for the block (a job applies them for its run)."""
    return AdaptationSet(adaptations())
