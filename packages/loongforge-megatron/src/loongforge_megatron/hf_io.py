"""Online HF checkpoints of this rank's model chunks: load an HF directory into its shards, export HF safetensors.

Both go through the model spec's name map and the conversion package's split/merge rules, so the offline
converter and training share one definition of every layout. The functions take the chunks (DDP-wrapped or
not), the parallel plan and the spec explicitly.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loongforge.errors import CheckpointError

from loongforge_megatron.engine.model import unwrap
from loongforge_megatron.models.lm import VOCAB_DIVISIBLE_BY


def _ranks():
    from megatron.core import parallel_state as mpu

    return dict(
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
    )


def _module_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items() if not k.endswith("_extra_state")}


def load_hf_into(chunks: list[torch.nn.Module], hf_dir: str | Path, *, plan: Any, whole: tuple[str, ...] = (),
                 log: Any = None, part: bool = False) -> None:
    """Load ``hf_dir`` into every model chunk of this rank; each rank reads only the tensors it holds. ``whole``:
    megatron-name prefixes of components every TP rank holds unsplit; ``part``: the chunks hold some components
    of the model only (an encoder on ranks of its own, or the language model beside it): the rank reads the
    tensors of those."""
    from loongforge_megatron.conversion import shard_state_dict_for_rank

    if not (Path(hf_dir) / "config.json").is_file():
        raise CheckpointError(f"checkpoint.load '{hf_dir}' is not an HF model directory (no config.json); a run's "
                              "own checkpoints resume with the same --output, other megatron checkpoints load "
                              "after `loongforge convert SRC DST --to hf`")
    for vpp_rank, module in enumerate(unwrap(m) for m in chunks):
        dtype = next(module.parameters()).dtype
        sd = shard_state_dict_for_rank(
            hf_dir, tp_size=plan.tp, pp_size=plan.pp, ep_size=plan.ep, etp_size=plan.etp, vpp_rank=vpp_rank,
            vpp_size=plan.vpp, make_vocab_size_divisible_by=VOCAB_DIVISIBLE_BY, expected_shapes=_module_shapes(module),
            held=module.state_dict().__contains__ if part else None,
            first_stage_layers=plan.first_stage_layers, last_stage_layers=plan.last_stage_layers,
            dtype=dtype, whole=whole, mtp_layers=getattr(module.config, "mtp_num_layers", None) or 0, **_ranks(),
        )
        missing, unexpected = module.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise CheckpointError(f"{hf_dir}: missing {missing[:3]} unexpected {unexpected[:3]} after loading")
    if log:
        log.info(f"[checkpoint] loaded HF weights from {hf_dir}")


def _comm_device() -> torch.device:
    """Where point-to-point buffers live for the default process group's backend."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class _Holdings:
    """Which global rank sends a tensor that the layout reads from ``(tp, pp, ep, vpp)``, and under which of its
    own keys (``mine`` of that rank).

    Each held ``(tp, pp, ep, vpp)`` key is served by the lowest global rank holding it (a data-parallel replica
    holds the same values). With expert tensor parallelism below TP (``etp < tp`` with ``ep > 1``) the expert
    grid does not follow the dense one: a process is (tp rank t, ep rank e) only for the pairs megatron formed,
    so the layout asks for keys no process has. Those are still held in substance: routed experts (not split
    at etp 1) are whole on every TP rank of their EP rank, and every other tensor is replicated over EP ranks.
    """

    def __init__(self, layout, everyone: list[dict]):
        from loongforge.checkpoint import Expert

        self.owner: dict = {}  # {key: {name: global rank}}
        self.specs: dict = {}
        # NOTE: per name: with an encoder on ranks of its own, two ranks hold different tensors under one key
        for rank, held in enumerate(everyone):
            for key, spec in held.items():
                owners, specs = self.owner.setdefault(key, {}), self.specs.setdefault(key, {})
                for name, s in spec.items():
                    if name not in owners:
                        owners[name], specs[name] = rank, s
        self.experts = {p.megatron for p in layout.params() if isinstance(p.rule, Expert)}
        self._resolved: dict = {}

    def source(self, rank, name: str) -> tuple[int, tuple]:
        """(global rank, its key) to read ``name`` of layout rank ``rank`` from."""
        if name in self.specs.get(rank, ()):
            return self.owner[rank][name], rank
        if (rank, name) not in self._resolved:
            tp, pp, ep, vpp = rank
            same = (lambda k: k[2] == ep) if name in self.experts else (lambda k: k[0] == tp)
            found = min((k for k in self.owner if (k[1], k[3]) == (pp, vpp) and same(k) and name in self.specs[k]),
                        default=None)
            if found is None:
                raise CheckpointError(f"no rank holds '{name}' of (tp {tp}, pp {pp}, ep {ep}, vpp {vpp})")
            self._resolved[(rank, name)] = self.owner[found][name], found
        return self._resolved[(rank, name)]

    def spec(self, rank, name: str):
        try:
            return self.specs[self.source(rank, name)[1]][name]
        except CheckpointError:
            raise CheckpointError(f"rank {rank}: the model has no tensor '{name}'") from None


def _gather_plan(chunks: list[torch.nn.Module], state: Callable[[torch.nn.Module], dict[str, torch.Tensor]], *,
                 spec: Any, arch: Any, plan: Any, whole: tuple[str, ...]):
    """What every rank holds under ``state(module)`` and who sends it: (layout, hf config, mine, holdings)."""
    from loongforge_megatron.conversion.layout import MegatronLayout

    modules = [unwrap(m) for m in chunks]
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[modules[0].config.params_dtype]
    config = spec.hf_config(arch, torch_dtype=dtype)
    layout = MegatronLayout(spec.name, config, tp=plan.tp, pp=plan.pp,
                            vpp=plan.vpp, ep=plan.ep, etp=plan.etp, make_vocab_size_divisible_by=VOCAB_DIVISIBLE_BY,
                            first_stage_layers=plan.first_stage_layers, last_stage_layers=plan.last_stage_layers,
                            whole=whole, mtp_layers=getattr(modules[0].config, "mtp_num_layers", None) or 0)
    r = _ranks()
    mine = {}
    for vpp_rank, module in enumerate(modules):
        mine[(r["tp_rank"], r["pp_rank"], r["ep_rank"], vpp_rank)] = {
            k: v.detach() for k, v in state(module).items() if not k.endswith("_extra_state")}
    shapes = {key: {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()} for key, sd in mine.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shapes)
    return layout, config, mine, _Holdings(layout, everyone)


def _receiver(mine, holdings: _Holdings) -> Callable:
    """Rank 0's ``read(rank, name)``: its own tensor, or a point-to-point receive from the rank holding it."""
    device = _comm_device()

    def read(rank, name):
        src, key = holdings.source(rank, name)
        if src == 0:
            return mine[key][name].cpu()
        dt, shape = holdings.specs[key][name]
        buf = torch.empty(shape, dtype=dt, device=device)
        dist.recv(buf, src=src)
        return buf.cpu()

    return read


def _send_mine(mine, holdings: _Holdings, rank, name: str, me: int, device: torch.device) -> None:
    """The sender's side of rank 0's ``read(rank, name)``: send it if this process is the one holding it."""
    src, key = holdings.source(rank, name)
    if src == me:
        dist.send(mine[key][name].to(device).contiguous(), dst=0)


def _gather_averaged(chunks: list[torch.nn.Module], state: Callable[[torch.nn.Module], dict[str, torch.Tensor]], *,
                     ema: Any, **model: Any):
    """:func:`_gather_plan` of the EMA weights when the recipe keeps them (``train.ema_decay``: every export holds
    the average, what EMA recipes evaluate and ship; with LoRA the averaged adapters, merged for the HF export),
    else of the trained weights."""
    if ema is None:
        return _gather_plan(chunks, state, **model)
    with ema.applied():
        layout, config, mine, holdings = _gather_plan(chunks, state, **model)
        # NOTE: copies: the parameters get the trained weights back when the block ends
        mine = {key: {k: v.clone() for k, v in sd.items()} for key, sd in mine.items()}
    return layout, config, mine, holdings


def export_hf(chunks: list[torch.nn.Module], out_dir: str | Path, *, spec: Any, arch: Any, plan: Any,
              whole: tuple[str, ...] = (), ema: Any = None, assets: Callable[[Path], None] | None = None,
              log: Any = None) -> Path | None:
    """Write the model (LoRA merged) as an HF directory on rank 0: config.json, safetensors + index, tokenizer
    (a diffusers model's folder: config.json + diffusion_pytorch_model.safetensors).

    Streams: rank 0 walks the HF tensors in order and every other rank sends each shard it owns point-to-point
    the moment the writer needs it, so rank 0 holds one tensor group at a time (plus its own shards). All
    ranks walk the same order (``hf_params`` x ``shard_sources``), which pairs every send with its receive.

    ``assets(staging)`` writes the files beside the weights (tokenizer, class labels); ``ema``: the weights'
    running average, exported instead of them.

    NOTE: if rank 0 fails mid-export the other ranks wait in ``send`` until the process-group timeout.
    """
    import json

    from loongforge_megatron.conversion.engine import MegatronSource, hf_params, to_hf_dir
    from loongforge_megatron.lora import merged_state_dict

    layout, config, mine, holdings = _gather_averaged(chunks, merged_state_dict, ema=ema, spec=spec, arch=arch,
                                                      plan=plan, whole=whole)
    me = dist.get_rank()
    out = None
    if me == 0:
        read = _receiver(mine, holdings)

        def put_assets(staging: Path) -> None:
            if assets is not None:
                assets(staging)
            (staging / "config.json").write_text(json.dumps(config, indent=2))

        out = Path(out_dir)
        to_hf_dir(MegatronSource(layout, read=read, spec=holdings.spec), layout, out, max_shard_bytes=5 * 2**30,
                  force=True, assets=put_assets)
        if log:
            log.info(f"[checkpoint] HF export -> {out}")
    else:
        # NOTE: mirrors the reads of rank 0's MegatronSource.write_rows, in the same order.
        device = _comm_device()
        source = MegatronSource(layout, read=None, spec=holdings.spec)
        for p in hf_params(layout):
            for rank, name in source.reads(p):
                _send_mine(mine, holdings, rank, name, me, device)
    dist.barrier()
    return out


def _peft_tensors(source, read: Callable, layout, lora_names: set[str], *,
                  peft_name: Callable[[str], str] = lambda n: n,
                  prefix: str = "base_model.model.") -> dict[str, torch.Tensor]:
    """PEFT-named A/B for every LoRA-wrapped linear, split per HF projection.

    The factor that is sharded like the base weight (B of a column-parallel layer, A of a row-parallel one)
    goes through the weight's own rule, so fused qkv B splits into q/k/v and fc1 B into gate/up exactly as
    the weight does; the replicated factor is copied to every HF projection of the group. ``peft_name``: a
    checkpoint tensor name -> the module path PEFT matches (the spec's ``peft_name``; a VLM's files and its
    transformers modules spell the language model differently); ``prefix``: what every name starts with (the
    spec's ``peft_prefix``).
    """
    from loongforge_megatron.conversion.engine import hf_params, key_of

    out = {}
    for p in hf_params(layout):
        src = source.params[key_of(p)]
        stem = src.megatron[: -len("weight")]
        if not src.megatron.endswith(".weight") or stem + "lora_A" not in lora_names:
            continue
        if src.rule.hf_row is not None:
            raise CheckpointError(f"PEFT has no adapter names for experts HF fuses into one tensor ('{p.hf['t']}'): "
                                  "train.lora.targets [qkv, proj], or checkpoint.save_format hf (merged)")
        ranks = layout.shard_sources(src)
        shards = {f: [read(rank, stem + f) for rank in ranks] for f in ("lora_A", "lora_B")}
        split, repl = ("lora_B", "lora_A") if _is_column(src) else ("lora_A", "lora_B")
        parts = src.rule.to_hf(shards[split])
        for role, t in parts.items():
            name = prefix + peft_name(p.hf[role])[: -len("weight")]
            out[name + split + ".weight"] = t.contiguous()
            out[name + repl + ".weight"] = shards[repl][0].clone()  # NOTE: safetensors refuses shared storage
    return out


def _is_column(p) -> bool:
    """Column-parallel linears split B (like their weight's rows); row-parallel ones split A."""
    from loongforge.checkpoint import RowParallel

    rule = getattr(p.rule, "inner", p.rule)
    return not isinstance(rule, RowParallel)


def export_peft(chunks: list[torch.nn.Module], out_dir: str | Path, *, lora: Any, base_model: str | None, spec: Any,
                arch: Any, plan: Any, whole: tuple[str, ...] = (), ema: Any = None, log: Any = None) -> Path | None:
    """Write the LoRA adapters as a PEFT directory on rank 0: ``adapter_model.safetensors`` +
    ``adapter_config.json``, with HF module names (fused qkv -> q/k/v_proj, fc1 -> gate/up_proj, proj -> o_proj,
    fc2 -> down_proj). Adapters are small, so rank 0 gathers them all, then writes atomically. ``lora``: the
    recipe's ``train.lora``; ``base_model``: the HF model the adapters apply to.
    """
    import json

    from loongforge.checkpoint.atomic import fsync_tree, replace_dir
    from safetensors.torch import save_file

    from loongforge_megatron.conversion.engine import MegatronSource
    from loongforge_megatron.lora import adapter_state_dict

    if lora is None:
        raise CheckpointError("checkpoint.save_format 'peft' needs train.stage: lora")
    layout, _, mine, holdings = _gather_averaged(chunks, adapter_state_dict, ema=ema, spec=spec, arch=arch, plan=plan,
                                                 whole=whole)
    me = dist.get_rank()
    lora_names = {n for held in holdings.specs.values() for n in held}
    out = None
    if me == 0:
        read = _receiver(mine, holdings)
        source = MegatronSource(layout, read=read, spec=holdings.spec)
        prefix = spec.peft_prefix
        tensors = _peft_tensors(source, read, layout, lora_names, peft_name=spec.peft_name, prefix=prefix)
        modules = sorted({k[len(prefix): k.rindex(".lora_")].rsplit(".", 1)[-1] for k in tensors})
        if spec.peft_module_paths:
            # NOTE: PEFT would adapt the model's other linears of the same names too
            modules = sorted({k[len(prefix): k.rindex(".lora_")] for k in tensors})
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "base_model_name_or_path": base_model, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        }
        out = Path(out_dir)
        staging = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_file(tensors, staging / spec.peft_weights, metadata={"format": "pt", **spec.peft_metadata(config)})
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2))
        fsync_tree(staging)
        replace_dir(staging, out)
        if log:
            log.info(f"[checkpoint] PEFT adapters -> {out}")
    else:
        # NOTE: mirrors rank 0's reads in _peft_tensors, in the same order.
        from loongforge_megatron.conversion.engine import hf_params, key_of

        device = _comm_device()
        source = MegatronSource(layout, read=None, spec=holdings.spec)
        for p in hf_params(layout):
            src = source.params[key_of(p)]
            stem = src.megatron[: -len("weight")]
            if not src.megatron.endswith(".weight") or stem + "lora_A" not in lora_names:
                continue
            for f in ("lora_A", "lora_B"):
                for rank in layout.shard_sources(src):
                    _send_mine(mine, holdings, rank, stem + f, me, device)
    dist.barrier()
    return out
