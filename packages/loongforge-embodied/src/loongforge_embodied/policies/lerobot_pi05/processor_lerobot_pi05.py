"""Our collated samples → ``PI05Pytorch.forward`` inputs, the way LeRobot's pi05 pre-processor and
``PI05Policy._preprocess_images`` / ``prepare_action`` do it, reusing their functions:

- state and actions normalised with LeRobot's ``NormalizerProcessorStep`` (QUANTILES q01/q99 as pi05's
  default, or MEAN_STD); actions and flow noise zero-/randomly padded to ``max_action_dim``;
- the prompt ``"Task: …, State: <256-bin ids>;\\nAction: "`` made by LeRobot's own
  ``Pi05PrepareStateTokenizerProcessorStep`` from the normalised state;
- tokens: with ``arch.tokenizer`` set, that Hugging Face tokenizer (LeRobot's is PaliGemma's), called as LeRobot's
  ``TokenizerProcessorStep`` calls it (right padding, truncation at ``tokenizer_max_length``). Unset (offline we
  have no PaliGemma tokenizer), the prompt is written in Gemma's byte-fallback tokens (``<0xNN>`` = id 217 + NN,
  after ``<bos>`` = 2): a valid PaliGemma token sequence (SentencePiece byte fallback decodes it to the same
  text), only longer than SentencePiece's own segmentation. Padding is ``<pad>`` = 0 on the right, to the
  batch's longest prompt rounded up to ``prompt_pad_multiple`` (``prompt_padding: longest``) or to
  ``tokenizer_max_length`` (``max_length``, LeRobot's). Padded keys are masked and positions count valid tokens
  only, so the valid tokens' outputs, and the loss, do not depend on how much padding follows them;
- images resized with padding to the model's resolution (``resize_with_pad_torch``) and mapped to [-1, 1].
"""

from __future__ import annotations

import functools
import os

import torch

from loongforge_embodied.policies.flow_noise import pad_noise
from loongforge_embodied.policies.lerobot_pi05.configuration_lerobot_pi05 import LeRobotPI05Arch, hub_cache

BOS, PAD, BYTE_OFFSET = 2, 0, 217  # Gemma / PaliGemma vocabulary: <bos>, <pad>, <0x00>
_steps: dict[int, tuple] = {}


def encode_prompts(prompts: list[str], *, max_length: int, padding: str = "max_length", multiple: int = 1,
                   tokenizer: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts → (ids, mask), ``<bos>`` first, truncated at ``max_length`` and right-padded with ``<pad>`` = 0:
    to ``max_length`` (``padding="max_length"``) or to the longest prompt rounded up to ``multiple``
    (``"longest"``). ``tokenizer``: a Hugging Face tokenizer's folder or cached hub id; "" = byte fallback."""
    if tokenizer:
        tok = load_tokenizer(tokenizer)
        rows = tok(prompts, max_length=max_length, truncation=True, add_special_tokens=True)["input_ids"]
        pad = tok.pad_token_id
    else:
        rows = [[BOS, *(BYTE_OFFSET + b for b in text.encode("utf-8"))][:max_length] for text in prompts]
        pad = PAD
    width = max_length
    if padding == "longest":
        longest = max(len(r) for r in rows)
        width = min(max_length, -(-longest // multiple) * multiple)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = True
    return ids, mask


def check_arch(arch: LeRobotPI05Arch) -> None:
    """Run once at job setup: the tokenizer loads (in the main process, so a bad one is one clear error there)."""
    if arch.tokenizer:
        load_tokenizer(arch.tokenizer)


def check_stats(arch: LeRobotPI05Arch, stats: dict) -> None:
    """Run once at job setup: the dataset statistics hold what the normaliser needs (q01/q99 with
    ``quantile_norm``, else mean/std)."""
    from loongforge.errors import RecipeError

    try:
        _lerobot_stats(stats, quantiles=bool(arch.quantile_norm))
    except ValueError as exc:
        raise RecipeError(str(exc), key="model.arch.quantile_norm") from None


@functools.cache
def load_tokenizer(name: str):
    """A Hugging Face tokenizer from a local folder or the local hub cache (never the network); one per process."""
    from loongforge.errors import RecipeError
    from transformers import AutoTokenizer

    # NOTE: every DataLoader worker encodes its own batches; a fast tokenizer's own thread pool per worker would
    # oversubscribe the cores (the user's setting wins).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as e:  # NOTE: a broken tokenizer file fails in many ways (OSError, ValueError, KeyError, ...)
        raise RecipeError(f"'{name}' does not load from a local folder or the Hugging Face cache ({hub_cache()}): "
                          f"{type(e).__name__}: {e}", key="model.arch.tokenizer") from e
    if tok.pad_token_id is None:
        raise RecipeError(f"'{name}' has no pad token (PaliGemma's is <pad> = 0)", key="model.arch.tokenizer")
    return tok


def _lerobot_stats(stats: dict[str, torch.Tensor], *, quantiles: bool) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for ours, theirs in (("state", "observation.state"), ("action", "action")):
        keys = ("q01", "q99") if quantiles else ("mean", "std")
        missing = [f"{ours}_{k}" for k in keys if f"{ours}_{k}" not in stats]
        if missing:
            raise ValueError(f"lerobot_pi05 normalisation needs {missing} from the dataset statistics (quantiles: "
                             "a LeRobot dataset's q01/q99; set model.arch.quantile_norm=0 for mean/std)")
        out[theirs] = {k: torch.as_tensor(stats[f"{ours}_{k}"], dtype=torch.float32) for k in keys}
    return out


def _processor_steps(arch: LeRobotPI05Arch, stats: dict[str, torch.Tensor]):
    """LeRobot's normaliser and pi05 state-prompt steps for ``stats`` (cached per stats object)."""
    hit = _steps.get(id(stats))
    if hit is not None and hit[0] is stats and hit[1] == arch:
        return hit[2]
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep
    from lerobot.processor import NormalizerProcessorStep

    mode = NormalizationMode.QUANTILES if arch.quantile_norm else NormalizationMode.MEAN_STD
    features = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(arch.state_dim,)),
                "action": PolicyFeature(type=FeatureType.ACTION, shape=(arch.action_dim,))}
    steps = (NormalizerProcessorStep(features=features, norm_map={FeatureType.STATE: mode, FeatureType.ACTION: mode},
                                     stats=_lerobot_stats(stats, quantiles=bool(arch.quantile_norm))),
             Pi05PrepareStateTokenizerProcessorStep(max_state_dim=arch.max_state_dim))
    _steps[id(stats)] = (stats, arch, steps)
    return steps


def unnormalize(x: torch.Tensor, key: str, *, stats: dict[str, torch.Tensor], quantiles: bool) -> torch.Tensor:
    """Inverse of LeRobot's normalisation of ``key`` (``state`` / ``action``) for model outputs."""
    if quantiles:
        q01, q99 = stats[f"{key}_q01"], stats[f"{key}_q99"]
        return (x + 1.0) * (q99 - q01) / 2.0 + q01
    return x * stats[f"{key}_std"] + stats[f"{key}_mean"]


def preprocess_images(images: torch.Tensor, *, resolution: int) -> torch.Tensor:
    """(B, cams, 3, H, W) in [0, 1] → (B, cams, 3, res, res) in [-1, 1], as ``PI05Policy._preprocess_images``."""
    from lerobot.policies.common.vla_utils import resize_with_pad_torch

    b, cams = images.shape[:2]
    x = images.flatten(0, 1).float().permute(0, 2, 3, 1)  # channels-last, as LeRobot resizes
    if x.shape[1:3] != (resolution, resolution):
        x = resize_with_pad_torch(x, resolution, resolution)
    x = (x * 2.0 - 1.0).permute(0, 3, 1, 2)
    return x.reshape(b, cams, *x.shape[1:])


def prepare_batch(raw: dict, *, arch: LeRobotPI05Arch, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collated samples (``images``, ``state``, ``task``, optional ``actions``/``noise``/``time``) → model inputs."""
    from lerobot.lerobot_types import TransitionKey
    from lerobot.policies.common.vla_utils import pad_vector

    normalize, prompt = _processor_steps(arch, stats)
    transition = {TransitionKey.OBSERVATION: {"observation.state": raw["state"].float()},
                  TransitionKey.COMPLEMENTARY_DATA: {"task": list(raw["task"])}}
    if "actions" in raw:
        transition[TransitionKey.ACTION] = raw["actions"].float()
    transition = prompt(normalize(transition))
    tokens, mask = encode_prompts(transition[TransitionKey.COMPLEMENTARY_DATA]["task"],
                                  max_length=arch.tokenizer_max_length, padding=arch.prompt_padding,
                                  multiple=arch.prompt_pad_multiple, tokenizer=arch.tokenizer)
    out = {"images": preprocess_images(raw["images"], resolution=arch.resolution), "lang_tokens": tokens,
           "lang_mask": mask}
    if "actions" in raw:
        out["actions"] = pad_vector(transition[TransitionKey.ACTION], arch.max_action_dim)
    if "noise" in raw:
        out["noise"] = pad_noise(raw["noise"].float(), arch.max_action_dim)
    if "time" in raw:
        out["time"] = raw["time"].float()
    return out
