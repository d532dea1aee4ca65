"""Training throughput of LeRobot's own GR00T N1.7 and FastWAM on one GPU: LoongForge's embodied trainer
(``lerobot_groot`` / ``lerobot_fastwam``: LeRobot's own networks and processor steps) vs LeRobot 0.6.1's
``GrootPolicy`` / ``FastWAMPolicy`` stepped the way ``lerobot-train`` steps it (named peer), at the published size.

    python benchmarks/policy_throughput.py --policy lerobot_groot --batch 32 --steps 20      # one GPU
    python benchmarks/policy_throughput.py --policy lerobot_fastwam --batch 8 --steps 20     # one GPU
    python benchmarks/policy_throughput.py --policy lerobot_groot --smoke    # CPU, tiny towers, 2 steps

What trains is LeRobot's default fine-tuning: GR00T N1.7's backbone frozen and its action head trained (1.6B of
3.1B; ``GrootConfig`` ``tune_llm`` / ``tune_visual`` off, ours ``model.freeze=[vision,language]``); FastWAM's video
expert frozen and its 1.0B action expert trained (``freeze_video_expert``, with ``loss.lambda_video`` 0 as its docs
ask; ours ``model.freeze=[video]``, ``video_loss_percent=0``). ``--train all`` trains FastWAM whole (the 5B video
DiT's weights, gradients and AdamW state take 80 GB at 30 layers: pair it with ``--layers``).

The towers are written here with random weights at the published sizes (no download): GR00T's backbone a Qwen3-VL
directory of Cosmos-Reason2-2B's sizes (Qwen3-VL-2B), FastWAM's frozen parts a Wan2.2-TI2V-5B VAE and a UMT5-XXL
encoder; both with a character-level tokenizer (prompts are padded to a fixed length either way for FastWAM; GR00T's
prompts are longer in characters than in Qwen tokens). ``--sizes tiny`` writes the tests' tiny towers. Both sides
start from the same random init (``init_sum`` in the JSON): GR00T's peer loads the GR00T N1.7 model directory written
from it (``GrootPolicy`` builds from ``base_model_path``); FastWAM's builds under the same seed, as ours does.

Ours: the job's step, data loading included (DataLoader workers, synthetic frames), bf16 as the recipe runs it. Peer
(``lerobot_step``): the model step alone, the policy under bf16 autocast (``lerobot_train.update_policy``) → backward
→ clip → AdamW with the policy's own optimizer preset (ours is given the same lr, betas, eps, weight decay and clip),
on a batch its own pre-processor made once and left on the GPU. FastWAM's peer holds its frozen VAE and text encoder
in bf16 as ours does (``frozen_dtype``). Loss curves differ (each side draws its own data and noise); samples/s, peak
memory, ratio last. Rows go to ``benchmarks/results/policy_throughput.md`` (see ``harness.py``).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
TASK = "Push the T-shaped block onto the target."
SEED = 0  # both sides build their random init under it
POLICIES = ("lerobot_groot", "lerobot_fastwam")
PRESET = {"lerobot_groot": "n1_7", "lerobot_fastwam": "fastwam"}
WAN_HUB_ID = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"  # where LeRobot's FastWAM reads its VAE (a fixed hub id)

# GR00T N1.7's backbone: Cosmos-Reason2-2B's architecture (Qwen3-VL-2B's config.json sizes), and the tests' tiny one
QWEN_SPECIAL = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == "
                 "'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                 "<|im_end|>\n{% endfor %}")
QWEN3_VL = {
    "published": ({"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 5000000.0,
                   "max_position_embeddings": 262144,
                   "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
                  {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                   "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                   "deepstack_visual_indexes": [5, 11, 17], "num_position_embeddings": 2304},
                  {"shortest_edge": 65536, "longest_edge": 16777216}),
    "tiny": ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16,
              "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
             {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "deepstack_visual_indexes": [1],
              "num_position_embeddings": 64},
             {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}),
}
# FastWAM's frozen parts: Wan2.2-TI2V-5B's VAE (its vae/config.json) and UMT5-XXL's encoder, and the tests' tiny ones
WAN_VAE = {
    "published": {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                  "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "in_channels": 12,
                  "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
                  "is_residual": True, "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48},
    "tiny": {"base_dim": 8, "z_dim": 48, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "is_residual": True,
             "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16,
             "temperal_downsample": [False, True, True], "latents_mean": [0.1] * 48, "latents_std": [1.5] * 48},
}
UMT5 = {
    "published": {"vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
                  "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
                  "relative_attention_max_distance": 128, "dropout_rate": 0.1, "tie_word_embeddings": False},
    "tiny": {"vocab_size": 100, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2,
             "dropout_rate": 0.0},
}


# ----------------------------------------------------------------------------------------------- the towers
def _char_tokenizer(words: list[str], **special):
    """A character-level tokenizer (transformers' fast tokenizer) with ``words`` first, then printable ASCII."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*words, "\n", *map(chr, range(32, 127))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **special), vocab


def write_qwen3_vl(out: Path, sizes: str) -> None:
    """A Qwen3-VL directory of ``sizes`` saved by transformers: config + processor (character-level tokenizer with
    Qwen3-VL's special tokens and a minimal chat template)."""
    from transformers import Qwen3VLConfig
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    text, vision, size = QWEN3_VL[sizes]
    hf, vocab = _char_tokenizer(["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", *QWEN_SPECIAL.values()],
                                pad_token="<|endoftext|>", eos_token="<|im_end|>", extra_special_tokens=QWEN_SPECIAL)
    hf.chat_template = QWEN_TEMPLATE
    Qwen3VLConfig(text_config={"vocab_size": len(vocab), **text}, vision_config=vision,
                  image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
                  vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"],
                  tie_word_embeddings=True).save_pretrained(out)
    patch = {k: vision[k] for k in ("patch_size", "temporal_patch_size")} | {"merge_size": vision["spatial_merge_size"]}
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**patch, size=size), tokenizer=hf,
                     video_processor=Qwen3VLVideoProcessor(**patch), chat_template=QWEN_TEMPLATE).save_pretrained(out)
    hf.save_pretrained(out)


def write_wan(out: Path, sizes: str) -> None:
    """A Wan2.2 directory of ``sizes``: ``vae/`` saved by diffusers, ``text_encoder/`` (UMT5 encoder) by
    transformers, in bf16 at the published size (FastWAM holds them frozen in bf16)."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    dtype = torch.bfloat16 if sizes == "published" else torch.float32
    torch.manual_seed(SEED)
    AutoencoderKLWan(**WAN_VAE[sizes]).to(dtype).save_pretrained(out / "vae")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # NOTE: UMT5-XXL's 5.7B weights made in bf16: half the host memory and time
    try:
        UMT5EncoderModel(UMT5Config(**UMT5[sizes])).save_pretrained(out / "text_encoder")
    finally:
        torch.set_default_dtype(default)


def write_umt5_tokenizer(out: Path) -> None:
    hf, _ = _char_tokenizer(["<pad>", "</s>", "<unk>"], pad_token="<pad>", eos_token="</s>")
    hf.save_pretrained(out)


def _arch(args):
    """The policy's arch as both sides build it."""
    if args.policy == "lerobot_groot":
        from loongforge_embodied.policies.lerobot_groot.configuration_lerobot_groot import PRESETS

        return PRESETS[args.preset].with_overrides(vlm=str(Path(args.work) / "vlm"))
    from loongforge_embodied.policies.lerobot_fastwam.configuration_lerobot_fastwam import PRESETS

    arch = PRESETS[args.preset]
    over = {"wan": str(Path(args.work) / "wan"), "tokenizer": str(Path(args.work) / "tokenizer")}
    if args.layers:
        over["num_layers"] = args.layers
    if args.train == "action":
        over["video_loss_percent"] = 0
    return arch.with_overrides(**over)


def prepare(args, work: Path) -> None:
    """The towers; for GR00T also the GR00T N1.7 model directory of the random init (its peer builds from it)."""
    if args.policy == "lerobot_groot":
        import torch
        from loongforge_embodied.policies.lerobot_groot.modeling_lerobot_groot import LeRobotGrootModel

        write_qwen3_vl(work / "vlm", args.sizes)
        torch.manual_seed(SEED)
        LeRobotGrootModel(_arch(args))._groot_model.save_pretrained(work / "groot_base")
        return
    write_wan(work / "wan", args.sizes)
    write_umt5_tokenizer(work / "tokenizer")
    # NOTE: LeRobot's FastWAM reads its VAE from a fixed hub id: a local hub cache whose snapshot is our directory
    repo = work / "hub" / ("models--" + WAN_HUB_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / ("0" * 40)).symlink_to(work / "wan", target_is_directory=True)


# ----------------------------------------------------------------------------------------------- the variants
def run_ours(args) -> dict:
    cuda = args.device == "cuda"
    arch = _arch(args)
    over = [f"model.preset={args.preset}", f"train.steps={args.steps}", f"train.seed={SEED}",
            f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}",
            f"train.precision={'bf16' if cuda else 'fp32'}", f"accelerator={args.device}", "train.warmup_steps=0",
            f"data.num_workers={args.workers}",
            f"data.synthetic_samples={args.batch * 16}", f"data.task={TASK}", "checkpoint.resume=never",
            "checkpoint.save_at_end=false", "logging.console=false", "logging.tensorboard=false"]
    preset = peer_config(args, arch).get_optimizer_preset()
    if args.policy == "lerobot_groot":
        over += [f"model.arch.vlm={arch.vlm}", "model.freeze=[vision,language]"]
    else:
        over += [f"model.arch.wan={arch.wan}", f"model.arch.tokenizer={arch.tokenizer}",
                 f"model.arch.num_layers={arch.num_layers}", f"model.arch.video_loss_percent={arch.video_loss_percent}"]
        if args.train == "action":
            over.append("model.freeze=[video]")
    over += [f"train.lr={preset.lr}", f"train.adam_beta1={preset.betas[0]}", f"train.adam_beta2={preset.betas[1]}",
             f"train.adam_eps={preset.eps}", f"train.weight_decay={preset.weight_decay}",
             f"train.grad_clip={preset.grad_clip_norm}"]
    recipe = ROOT / "recipes" / "embodied" / f"{args.policy}_tiny.yaml"
    return harness.run_job(recipe, over, steps=args.steps, device=args.device, items=args.batch)


def peer_config(args, arch):
    """LeRobot's config of the peer: ``GrootConfig`` (building from the GR00T N1.7 directory ``prepare`` wrote) or
    ``FastWAMConfig``, with LeRobot's default fine-tuning (what trains: see the module's docstring)."""
    if args.policy == "lerobot_groot":
        from loongforge_embodied.policies.lerobot_groot.build import policy_config

        config = policy_config(arch, base=str(Path(args.work) / "groot_base"))
        config.tune_llm = config.tune_visual = False  # NOTE: LeRobot's defaults (ours: model.freeze)
        config.use_bf16 = args.device == "cuda"
        return config
    from loongforge_embodied.policies.lerobot_fastwam.build import fastwam_config

    config = fastwam_config(arch)
    config.freeze_video_expert = args.train == "action"  # NOTE: ours: model.freeze=[video]
    return config


@contextlib.contextmanager
def _wan_hub(work: Path):
    """LeRobot's FastWAM reads its VAE from ``WAN_HUB_ID`` in the hub cache: the cache ``prepare`` made, offline."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = str(work / "hub"), True
    try:
        yield
    finally:
        constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = saved


def _groot_peer(args, arch, config):
    """``GrootPolicy`` and a batch LeRobot's own N1.7 pack / VLM-encode steps made (as in its pre-processor)."""
    import torch
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from lerobot.policies.groot.processor_groot import GrootN17PackInputsStep, GrootN17VLMEncodeStep
    from lerobot.processor import PolicyProcessorPipeline

    policy = GrootPolicy(config)
    pre = PolicyProcessorPipeline(steps=[
        GrootN17PackInputsStep(action_horizon=arch.chunk_size, valid_action_horizon=arch.chunk_size,
                               max_state_dim=arch.max_state_dim, max_action_dim=arch.max_action_dim, stats={}),
        GrootN17VLMEncodeStep(model_name=arch.vlm, image_crop_size=[arch.image_crop_size] * 2,
                              image_target_size=[arch.image_target_size] * 2)])
    g = torch.Generator().manual_seed(0)
    b = args.batch
    frames = {f"observation.images.cam{i}": torch.rand(b, 3, arch.image_size, arch.image_size, generator=g)
              for i in range(arch.num_cameras)}
    batch = pre({**frames, "observation.state": torch.randn(b, arch.state_dim, generator=g),
                 "action": torch.randn(b, arch.chunk_size, arch.action_dim, generator=g),
                 "action_is_pad": torch.zeros(b, arch.chunk_size, dtype=torch.bool), "task": [TASK] * b})
    return policy, batch


def _fastwam_peer(args, arch, config):
    """``FastWAMPolicy`` (its frozen VAE and text encoder in ``arch.frozen_dtype``, as ours holds them) and a batch
    its own pre-processor made."""
    import torch
    from lerobot.policies.fastwam import FastWAMPolicy, make_fastwam_pre_post_processors

    with _wan_hub(Path(args.work)):
        policy = FastWAMPolicy(config)  # NOTE: built on the CPU as ours is, so both draw the same init
    frozen = getattr(torch, arch.frozen_dtype)
    policy.model.vae.vae.to(frozen)
    policy.model.text_encoder.model.to(frozen)
    stats = {k: {"mean": torch.zeros(n), "std": torch.ones(n)}
             for k, n in (("observation.state", arch.state_dim), ("action", arch.action_dim))}
    pre, _ = make_fastwam_pre_post_processors(config, dataset_stats=stats)
    g = torch.Generator().manual_seed(0)
    b, clip = args.batch, len(arch.frame_offsets)
    frames = {f"observation.images.cam{i}": torch.rand(b, clip, 3, arch.image_size, arch.image_size, generator=g)
              for i in range(arch.num_cameras)}
    batch = pre({**frames, "observation.state": torch.randn(b, arch.state_dim, generator=g),
                 "action": torch.randn(b, arch.chunk_size, arch.action_dim, generator=g),
                 "action_is_pad": torch.zeros(b, arch.chunk_size, dtype=torch.bool), "task": [TASK] * b})
    return policy, batch


def run_lerobot(args) -> dict:
    import torch

    arch = _arch(args)
    config = peer_config(args, arch)
    torch.manual_seed(SEED)
    policy, batch = (_groot_peer if args.policy == "lerobot_groot" else _fastwam_peer)(args, arch, config)
    policy.to(args.device).train()
    if args.policy == "lerobot_fastwam":
        policy.model.device = torch.device(args.device)  # NOTE: FastWAM moves its inputs to the device it was built on
    batch = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    step, params = harness.lerobot_step(policy, batch, device=args.device)
    start = harness.init_sum(params)
    res = harness.time_steps(step, steps=args.steps, device=args.device)
    return {**res, "items": args.batch, "trainable_m": sum(p.numel() for p in params) / 1e6, "init_sum": start}


VARIANTS = {"loongforge": run_ours, "lerobot_step": run_lerobot}

BENCH = harness.Bench(name="policy_throughput", script=__file__, variants=VARIANTS, unit="samples/s",
                      pairs=[("loongforge", "lerobot_step")],
                      columns={"trainable M": lambda r: f"{r.get('trainable_m', 0):.1f}"})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", required=True, choices=POLICIES)
    p.add_argument("--preset", default=None, help="the policy's preset (default: its published one)")
    p.add_argument("--sizes", default="published", choices=["published", "tiny"], help="the towers written")
    p.add_argument("--layers", type=int, default=None, help="FastWAM: MoT layers (default: the preset's 30)")
    p.add_argument("--train", default="action", choices=["action", "all"],
                   help="FastWAM: the action expert (video expert frozen, LeRobot's freeze_video_expert) or all")
    p.add_argument("--batch", type=int, default=None, help="default: 32 (GR00T), 8 (FastWAM)")
    p.add_argument("--workers", type=int, default=8, help="ours: DataLoader workers")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    harness.add_args(p, variants=VARIANTS, default="loongforge,lerobot_step")
    args = harness.parse(p, argv, steps=20, warmup=5, smoke={
        "preset": "tiny", "sizes": "tiny", "batch": 2, "workers": 0, "device": "cpu"})
    args.preset = args.preset or PRESET[args.policy]
    args.batch = args.batch or (32 if args.policy == "lerobot_groot" else 8)
    if args.policy == "lerobot_groot" and (args.layers or args.train != "action"):
        p.error("--layers / --train are FastWAM's")
    what = ("backbone frozen, action head trained" if args.policy == "lerobot_groot" else
            f"{args.layers or 'all'} layers, " + ("video expert frozen" if args.train == "action" else "all trained"))
    setup = (f"{args.policy} {args.preset} ({args.sizes} towers), batch {args.batch}, "
             f"{'bf16' if args.device == 'cuda' else 'fp32'}, {what}, synthetic frames")
    return BENCH.main(args, setup=setup, device=args.device, prepare=prepare)


if __name__ == "__main__":
    main()
