"""Block-scaled FP8 HF checkpoints (the published DeepSeek-V3 / V3.2 / Kimi-K2 format): dequantized as they are
read, quantized as an export writes them.

The format: a quantized linear's ``X.weight`` is ``float8_e4m3fn`` and sits beside ``X.weight_scale_inv`` (float32,
one value per ``[bm, bn]`` block of the weight's last two dims, counted with ceil division so a partial block at
the edge has its own scale); config.json says ``quantization_config: {quant_method: fp8, fmt: e4m3,
weight_block_size: [128, 128], activation_scheme: dynamic}``. A weight's value is ``fp8 * scale_inv`` in float32.
Embeddings, the output head, norms and routers stay in bf16 / fp32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from loongforge.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# NOTE: the linears the published checkpoints quantize: every projection of a decoder layer (attention, dense MLP,
# routed and shared experts: ``*_proj``, and the ``experts.N.w1 / w2 / w3`` of Mixtral-style MoE blocks such as
# MiniMax-M2's); the router (mlp.gate, block_sparse_moe.gate), norms, embeddings, heads and the MTP eh_proj stay
# unquantized
_QUANTIZED = re.compile(r"^model\.layers\.\d+\.(?!eh_proj\.)(.*_proj(_with_mqa)?|.*\.experts\.\d+\.w[123])\.weight$")
# NOTE: the names of e4m3 a config.json may give (DeepSeek-V3's "e4m3", MiniMax-M2's "float8_e4m3fn")
_E4M3_NAMES = ("e4m3", "float8_e4m3fn")


@dataclass(frozen=True)
class BlockFp8:
    """One checkpoint's FP8 block format."""

    block: tuple[int, int] = (128, 128)
    fmt: str = "e4m3"  # NOTE: the checkpoint's own name for it, written back as it was read

    def config(self) -> dict[str, Any]:
        """config.json's ``quantization_config`` for this format (what the published checkpoints say)."""
        return {"activation_scheme": "dynamic", "fmt": self.fmt, "quant_method": "fp8",
                "weight_block_size": list(self.block)}

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The ``weight_scale_inv`` shape of a weight of ``shape`` (ceil-divided blocks of its last two dims)."""
        bm, bn = self.block
        return (*shape[:-2], -(-shape[-2] // bm), -(-shape[-1] // bn))

    def quantizes(self, name: str, shape: tuple[int, ...], *, skip: tuple[str, ...] = ()) -> bool:
        """Whether an export in this format stores HF tensor ``name`` as FP8 (``skip``: the config's
        ``modules_to_not_convert``)."""
        return len(shape) >= 2 and bool(_QUANTIZED.match(name)) and not any(s and s in name for s in skip)


def read_quant_config(hf_config: dict[str, Any], *, where: Any) -> BlockFp8 | None:
    """config.json's ``quantization_config`` as a :class:`BlockFp8` (None: not quantized); anything else is one
    line naming the key and what is allowed."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    key = "quantization_config"
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: key '{key}' is {type(q).__name__}, expected an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{where}: key '{key}.quant_method' is {method!r}; LoongForge reads block-scaled "
                              "FP8 checkpoints (quant_method 'fp8') only")
    fmt = q.get("fmt", "e4m3")
    if fmt not in _E4M3_NAMES:
        raise CheckpointError(f"{where}: key '{key}.fmt' is {str(fmt)[:40]!r}; allowed: "
                              f"{', '.join(repr(n) for n in _E4M3_NAMES)}")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where}: key '{key}.activation_scheme' is {q.get('activation_scheme')!r}; allowed: "
                              "'dynamic' (static activation scales are not read)")
    if q.get("scale_fmt", "float") not in ("float", "ue8m0", None):
        raise CheckpointError(f"{where}: key '{key}.scale_fmt' is {q.get('scale_fmt')!r}; allowed: 'float', "
                              "'ue8m0'")
    block = q.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(type(b) is int and 0 < b <= 2**16 for b in block)):
        raise CheckpointError(f"{where}: key '{key}.weight_block_size' is {str(block)[:60]}; expected two positive "
                              "block sizes such as [128, 128] (per-tensor FP8 scales are not read)")
    return BlockFp8(tuple(block), fmt)


def checkpoint_dtype(hf_config: dict[str, Any]) -> torch.dtype:
    """The dtype of a checkpoint's unquantized weights, which its FP8 weights dequantize to (config.json's
    ``dtype`` / ``torch_dtype``; bfloat16, the published checkpoints', when absent)."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return _DTYPE_NAMES.get(name, torch.bfloat16) if isinstance(name, str) else torch.bfloat16


def dequantize(q: torch.Tensor, scale: torch.Tensor, *, block: tuple[int, int], first_row: int = 0) -> torch.Tensor:
    """float32 values of FP8 ``q`` (``[..., rows, cols]``) with their block scales. For a 2-D ``q`` that is rows
    ``first_row..`` of a weight, ``scale`` holds the scale rows of the blocks those rows lie in, from
    ``first_row // bm`` on."""
    bm, bn = block
    if q.dim() == 2:
        rows = torch.arange(first_row, first_row + q.shape[0]) // bm - first_row // bm
        s = scale.to(torch.float32)[rows]
    else:
        s = scale.to(torch.float32).repeat_interleave(bm, dim=-2)[..., : q.shape[-2], :]
    return q.to(torch.float32) * s.repeat_interleave(bn, dim=-1)[..., : q.shape[-1]]


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w`` zero-padded to whole blocks, as ``[..., block rows, bm, block cols, bn]``."""
    bm, bn = block
    rows, cols = w.shape[-2:]
    padded = torch.nn.functional.pad(w, (0, -cols % bn, 0, -rows % bm))
    return padded.unflatten(-1, (-1, bn)).unflatten(-3, (-1, bm))


def quantize(w: torch.Tensor, *, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 ``weight_scale_inv``) of ``w`` with one scale per block, ``amax / 448`` as the
    published checkpoints compute it.

    NOTE: a block whose values are exactly the float32 dequantization of FP8 data gets back the scale they were
    dequantized with (``amax / 448`` can be an ulp off it: one block in ten), so a checkpoint loaded from FP8 and
    exported untrained reproduces its bytes; the nearest candidate scale whose dequantization reproduces every
    value of the block is taken.
    """
    rows, cols = w.shape[-2:]
    b = _blocks(w.detach().to(torch.float32), block)
    amax = b.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))

    def fp8_of(s: torch.Tensor) -> torch.Tensor:
        return (b / s[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    best, found = scale, torch.zeros_like(amax, dtype=torch.bool)
    down, up = scale, scale
    candidates = [scale]
    for _ in range(2):  # one ulp below, one above, two below, two above
        down = torch.nextafter(down, torch.zeros_like(down))
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        candidates += [down, up]
    for cand in candidates:
        exact = (fp8_of(cand).to(torch.float32) * cand[..., :, None, :, None] == b).all(dim=-1).all(dim=-2)
        best = torch.where(exact & ~found, cand, best)
        found |= exact
    q = fp8_of(best).flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols].contiguous()
    return q, best.contiguous()


class Fp8Reader:
    """A safetensors reader that serves block-scaled FP8 weights as ``dtype`` values and hides their scales.

    Reading rows (``read_rows``) dequantizes just those rows with just their blocks' scales, so a rank that
    holds a slice of a column-parallel weight reads and dequantizes only its slice (``read_columns``: the columns
    of a row-parallel slice). ``dequantized`` / ``dequantized_columns`` record what was dequantized, in order.
    """

    def __init__(self, reader: Any, fmt: BlockFp8, *, dtype: torch.dtype, where: Any):
        self._reader, self.path, self.fmt, self.dtype_out = reader, reader.path, fmt, dtype
        self._scale: dict[str, str] = {}
        self.dequantized: list[tuple[str, int, int]] = []
        self.dequantized_columns: list[tuple[str, tuple[int, ...]]] = []
        names = reader.keys()
        for name in names:
            scale = name + SCALE_SUFFIX
            if name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)]
                if weight not in reader:
                    raise CheckpointError(f"{where}: scale '{name}' has no weight '{weight}' beside it")
                continue
            dt = reader.dtype(name)
            if dt not in _FP8_DTYPES:
                if scale in reader:
                    raise CheckpointError(f"{where}: '{scale}' scales '{name}', which is stored as "
                                          f"{str(dt).removeprefix('torch.')}, not float8_e4m3fn")
                continue
            if dt != FP8:
                raise CheckpointError(f"{where}: tensor '{name}' is stored as {str(dt).removeprefix('torch.')}; "
                                      "block-scaled FP8 checkpoints store float8_e4m3fn (fmt e4m3)")
            if scale not in reader:
                raise CheckpointError(f"{where}: FP8 tensor '{name}' has no '{scale}' (a block-scaled FP8 "
                                      "checkpoint carries one scale tensor per quantized weight)")
            shape = tuple(reader.shape(name))
            if len(shape) < 2:
                raise CheckpointError(f"{where}: FP8 tensor '{name}' has shape {shape}; block-scaled weights have "
                                      "two or more dims")
            want, have = fmt.scale_shape(shape), tuple(reader.shape(scale))
            if have != want:
                raise CheckpointError(f"{where}: '{scale}' has shape {have} but '{name}' {shape} in "
                                      f"{fmt.block[0]}x{fmt.block[1]} blocks needs {want}")
            if not reader.dtype(scale).is_floating_point or reader.dtype(scale) in _FP8_DTYPES:
                raise CheckpointError(f"{where}: '{scale}' is stored as "
                                      f"{str(reader.dtype(scale)).removeprefix('torch.')}; float32 scales expected")
            self._scale[name] = scale
        self._names = [n for n in names if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self._scale)]
        self._name_set = set(self._names)

    @property
    def quantized(self) -> list[str]:
        """The FP8 weights' names."""
        return list(self._scale)

    def keys(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._name_set

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.dtype_out if name in self._scale else self._reader.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._scale:
            return self._reader.get(name)
        shape = self._reader.shape(name)
        self.dequantized.append((name, 0, shape[0]))
        q, s = self._reader.get(name), self._reader.get(self._scale[name])
        return dequantize(q, s, block=self.fmt.block).to(self.dtype_out)

    def read_rows(self, name: str, row: int, out: torch.Tensor) -> torch.Tensor:
        if name not in self._scale:
            return self._reader.read_rows(name, row, out)
        if out.dtype != self.dtype_out:
            raise CheckpointError(f"{self.path}: cannot read '{name}' into {out.dtype} (it dequantizes to "
                                  f"{self.dtype_out})")
        n = out.shape[0]
        q = self._reader.read_rows(name, row, torch.empty(out.shape, dtype=FP8))
        scale, bm = self._scale[name], self.fmt.block[0]
        if q.dim() == 2:
            first, last = row // bm, (row + n - 1) // bm if n else row // bm - 1
            s_shape = self._reader.shape(scale)
            s = self._reader.read_rows(scale, first, torch.empty((last - first + 1, *s_shape[1:]),
                                                                   dtype=self._reader.dtype(scale)))
        else:  # NOTE: dim 0 of a stacked (experts) weight indexes whole matrices, each with its own scale grid
            s_shape = self._reader.shape(scale)
            s = self._reader.read_rows(scale, row, torch.empty((n, *s_shape[1:]), dtype=self._reader.dtype(scale)))
        self.dequantized.append((name, row, n))
        out.copy_(dequantize(q, s, block=self.fmt.block, first_row=row if q.dim() == 2 else 0))
        return out

    def read_columns(self, name: str, cols: torch.Tensor) -> torch.Tensor | None:
        """Columns ``cols`` of FP8 weight ``name`` (its last dim), dequantized: the FP8 bytes are read whole (one
        byte a value), only the columns are dequantized. None when ``name`` is not an FP8 weight."""
        if name not in self._scale:
            return None
        q = self._reader.get(name)[..., cols]
        s = self._reader.get(self._scale[name]).to(torch.float32)
        s = s.repeat_interleave(self.fmt.block[0], dim=-2)[..., : q.shape[-2], :][..., cols // self.fmt.block[1]]
        self.dequantized_columns.append((name, tuple(cols.tolist())))
        return (q.to(torch.float32) * s).to(self.dtype_out)


def fp8_reader(reader: Any, hf_config: dict[str, Any], *, where: Any, dtype: torch.dtype | None = None) -> Any:
    """``reader`` as an :class:`Fp8Reader` when config.json declares block-scaled FP8 (``dtype``: what its FP8
    weights dequantize to; default the checkpoint's own dtype), else ``reader`` itself; FP8 tensors without a
    ``quantization_config`` are one line naming the first."""
    fmt = read_quant_config(hf_config, where=where)
    if fmt is None:
        for name in reader.keys():
            if reader.dtype(name) in _FP8_DTYPES or name.endswith(SCALE_SUFFIX):
                raise CheckpointError(f"{where}: tensor '{name}' is part of an FP8 checkpoint but config.json has no "
                                      "quantization_config (block-scaled FP8 checkpoints declare quant_method 'fp8')")
        return reader
    return Fp8Reader(reader, fmt, dtype=dtype or checkpoint_dtype(hf_config), where=where)


def modules_to_not_convert(hf_config: dict[str, Any]) -> tuple[str, ...]:
    """The module names a checkpoint's ``quantization_config`` keeps unquantized."""
    q = hf_config.get("quantization_config")
    skip = q.get("modules_to_not_convert") if isinstance(q, dict) else None
    return tuple(s for s in skip if isinstance(s, str)) if isinstance(skip, list) else ()


class Fp8Export:
    """An HF export's FP8 side: which tensors it stores as FP8 (+ scale), and the writes that quantize them.

    A quantized tensor's rows arrive shard by shard; they are gathered whole (one tensor at a time, in float32)
    and written as FP8 with its ``weight_scale_inv`` once the last row is in, because a 128-row block spans shards.
    """

    def __init__(self, fmt: BlockFp8, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], *,
                 skip: tuple[str, ...] = ()):
        self.fmt = fmt
        self._shape = {n: tuple(s) for n, (_, s) in specs.items() if fmt.quantizes(n, tuple(s), skip=skip)}
        if not self._shape:
            raise CheckpointError("an FP8 export quantizes the decoder layers' linear weights "
                                  "(model.layers.N.*_proj.weight, model.layers.N.*.experts.M.w1 / w2 / w3.weight) "
                                  "and this model has none")
        self._buf: dict[str, list] = {}

    def specs(self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict:
        """``specs`` as written: each quantized tensor FP8, its scale right after it."""
        out = {}
        for name, spec in specs.items():
            if name in self._shape:
                out[name] = (FP8, self._shape[name])
                out[name + SCALE_SUFFIX] = (torch.float32, self.fmt.scale_shape(self._shape[name]))
            else:
                out[name] = spec
        return out

    def add_rows(self, writer: Any, name: str, row: int, t: torch.Tensor) -> None:
        """``writer.add_rows(name, row, t)``, or, for a quantized tensor, gather and write it when complete."""
        if name not in self._shape:
            writer.add_rows(name, row, t)
            return
        shape = self._shape[name]
        if name not in self._buf:
            self._buf[name] = [torch.empty(shape, dtype=torch.float32), shape[0]]
        buf = self._buf[name]
        buf[0][row:row + t.shape[0]] = t
        buf[1] -= t.shape[0]
        if buf[1] <= 0:
            q, scale = quantize(self._buf.pop(name)[0], block=self.fmt.block)
            writer.add(name, q)
            writer.add(name + SCALE_SUFFIX, scale)
