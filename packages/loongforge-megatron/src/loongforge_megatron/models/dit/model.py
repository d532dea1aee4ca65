"""DiT's model (Peebles & Xie) on megatron-core: a class-conditional latent diffusion transformer, its training
objective and forward step.

The transformer is megatron's own ``TransformerBlock`` of :class:`AdaLNZeroLayer` s: a ``TransformerLayer`` whose
``SelfAttention`` (fused QKV, non-causal: ``AttnMaskType.no_mask``) and ``MLP`` (GELU-tanh) are megatron's, built
from a ``ModuleSpec``, so tensor parallelism goes through megatron's column / row parallel linears. The layer adds
adaLN-Zero around them: a column-parallel linear (output gathered) maps the conditioning vector to
shift / scale / gate for attention and MLP, applied to non-affine LayerNorms; it is zero-initialised, so every
block starts as the identity. The conditioning vector (timestep embedding + class embedding, shared by all blocks)
travels through the block as megatron's ``context`` argument, which ``TransformerBlock`` hands to every layer.

The module follows diffusers' ``DiTTransformer2DModel`` exactly (its frequency layout of the timestep embedding,
its LayerNorm eps), so a diffusers checkpoint computes the same function here. Pipeline / context / sequence
parallelism are not supported.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import make_viewless_tensor

from loongforge_megatron.engine.step import _to_device
from loongforge_megatron.layers.attention import SDPAttention
from loongforge_megatron.layers.megatron_layers import row_parallel_linear

LOSS_KEY = "diffusion loss"
TIMESTEP_CHANNELS = 256  # sinusoidal features fed to the timestep MLP (DiT's frequency_embedding_size)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """DiT's MLP activation (diffusers' ``gelu-approximate``)."""
    return F.gelu(x, approximate="tanh")


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def timestep_features(t: torch.Tensor, dim: int = TIMESTEP_CHANNELS) -> torch.Tensor:
    """Sinusoidal timestep features ``[b, dim]``, [cos | sin], as diffusers' DiT computes them.

    NOTE: diffusers' ``Timesteps(flip_sin_to_cos=True, downscale_freq_shift=1)`` spaces the frequencies by
    ``1 / (dim/2 - 1)``; the original DiT code by ``1 / (dim/2)``. We follow diffusers, whose checkpoints we load.
    """
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - 1)
    args = t[:, None].float() * torch.exp(exponent)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding ``[grid*grid, dim]`` (MAE / DiT / diffusers): the first half of the
    channels encodes the column, the second half the row; tokens are row-major."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                                indexing="ij")

    def embed(pos: torch.Tensor) -> torch.Tensor:
        out = pos.reshape(-1, 1) * omega[None]
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    return torch.cat([embed(cols), embed(rows)], dim=1).float()


def _layer_norm(fixed_eps: float | None = None):
    """A megatron norm builder: a LayerNorm without affine parameters (adaLN supplies scale and shift);
    ``fixed_eps`` replaces the config's epsilon."""

    def build(config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        return torch.nn.LayerNorm(hidden_size, eps=eps if fixed_eps is None else fixed_eps,
                                  elementwise_affine=False, dtype=config.params_dtype)

    return build


def _column_gathered(config: Any, size_in: int, size_out: int, tp_group: Any = None) -> ColumnParallelLinear:
    """A zero-initialised column-parallel linear whose output is gathered on every TP rank (adaLN modulation)."""
    return ColumnParallelLinear(size_in, size_out, config=config, init_method=torch.nn.init.zeros_, bias=True,
                                gather_output=True, skip_bias_add=False, tp_group=tp_group)


class AdaLNZeroLayer(TransformerLayer):
    """megatron's TransformerLayer with adaLN-Zero modulation (``context`` is the conditioning ``[1, b, h]``)::

        shift1, scale1, gate1, shift2, scale2, gate2 = adaln_modulation(silu(c))
        x = x + gate1 * attention(norm1(x) * (1 + scale1) + shift1)
        x = x + gate2 * mlp(norm2(x) * (1 + scale2) + shift2)
    """

    def __init__(self, config: Any, submodules: Any, layer_number: int = 1, **kwargs: Any):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        self.adaln_modulation = _column_gathered(config, config.hidden_size, 6 * config.hidden_size,
                                                 tp_group=self.tp_group)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, context: Any = None,
                **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        mod, _bias = self.adaln_modulation(F.silu(context))
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)
        x = hidden_states
        out, bias = self.self_attention(modulate(self.input_layernorm(x), shift1, scale1), attention_mask=None)
        x = x + gate1 * (out if bias is None else out + bias)
        out, bias = self.mlp(modulate(self.pre_mlp_layernorm(x), shift2, scale2))
        x = x + gate2 * (out if bias is None else out + bias)
        # NOTE: megatron's checkpointing and schedules reject view tensors as layer outputs.
        return make_viewless_tensor(inp=x, requires_grad=x.requires_grad, keep_graph=True), context


def layer_spec(*, attention: str = "sdpa"):
    """The DiT layer's ModuleSpec: megatron SelfAttention (no mask) + MLP, non-affine LayerNorms (eps 1e-6 before
    attention as diffusers' AdaLayerNormZero, the config's ``layernorm_epsilon`` before the MLP as its norm3).
    ``attention``: ``sdpa`` (our SDPA core attention) or ``local`` (megatron's DotProductAttention)."""
    core = {"sdpa": SDPAttention, "local": DotProductAttention}[attention]
    return ModuleSpec(
        module=AdaLNZeroLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=_layer_norm(1e-6),
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},  # NOTE: full bidirectional attention over patches
                submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=core,
                                                   linear_proj=row_parallel_linear()),
            ),
            pre_mlp_layernorm=_layer_norm(),
            mlp=functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(
                linear_fc1=ColumnParallelLinear, linear_fc2=row_parallel_linear())),
        ),
    )


def transformer_config(arch: Any, *, plan: Any, precision: str, grad_accum_fusion: bool = False):
    """megatron-core ``TransformerConfig`` of a DiT under ``plan``.

    NOTE: initialised on the CPU whatever the device (``use_cpu_initialization``): megatron then draws each
    parallel weight whole and splits it, so DiT's xavier-uniform fans are those of the full matrices and every
    TP layout starts from the same weights.
    """
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_attention_heads,
        kv_channels=arch.head_dim, normalization="LayerNorm", layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=False, activation_func=gelu_tanh, add_bias_linear=True, add_qkv_bias=True,
        qk_layernorm=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method=torch.nn.init.xavier_uniform_, output_layer_init_method=torch.nn.init.xavier_uniform_,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=grad_accum_fusion, persist_layer_norm=False, tensor_model_parallel_size=plan.tp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=precision == "bf16", fp16=precision == "fp16",
        use_cpu_initialization=True, calculate_per_token_loss=True, variable_seq_lengths=False,
    )
    if plan.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=plan.recompute_layers or 1)
    elif plan.recompute == "selective":
        kw.update(recompute_granularity="selective")
    return TransformerConfig(**kw)


class _TimestepEmbedder(torch.nn.Module):
    """Sinusoidal features -> Linear -> SiLU -> Linear (diffusers' ``TimestepEmbedding``)."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.linear_1 = torch.nn.Linear(TIMESTEP_CHANNELS, hidden, dtype=dtype)
        self.linear_2 = torch.nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = timestep_features(t).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(x)))


class _ClassEmbedder(torch.nn.Module):
    """Class labels -> vectors; row ``num_classes`` is the null class that classifier-free guidance trains."""

    def __init__(self, num_classes: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.embedding_table = torch.nn.Embedding(num_classes + 1, hidden, dtype=dtype)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(labels)


class _FinalLayer(torch.nn.Module):
    """adaLN (shift, scale) of the last hidden states, then a linear to ``p*p*out_channels`` per patch."""

    def __init__(self, config: Any, hidden: int, out: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden, eps=1e-6, elementwise_affine=False, dtype=config.params_dtype)
        self.adaln_modulation = _column_gathered(config, hidden, 2 * hidden)
        self.linear = torch.nn.Linear(hidden, out, dtype=config.params_dtype)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaln_modulation(F.silu(c))[0].chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


class DiTModel(MegatronModule):
    """``forward(latents [b, C, H, W], timesteps [b], labels [b]) -> [b, out_channels, H, W]``.

    patch embedding (conv p x p) + fixed 2-D sin-cos positions -> megatron TransformerBlock of adaLN-Zero layers
    (conditioning = timestep embedding + class embedding) -> final adaLN + linear -> unpatchify.
    """

    def __init__(self, config: Any, arch: Any, *, attention: str = "sdpa"):
        super().__init__(config=config)
        self.arch = arch
        h, p, dtype = arch.hidden_size, arch.patch_size, config.params_dtype
        self.patch_embed = torch.nn.Conv2d(arch.in_channels, h, kernel_size=p, stride=p, bias=True, dtype=dtype)
        self.register_buffer("pos_embed", sincos_2d(h, arch.sample_size // p), persistent=False)
        self.t_embedder = _TimestepEmbedder(h, dtype)
        self.y_embedder = _ClassEmbedder(arch.num_classes, h, dtype)
        spec = TransformerBlockSubmodules(layer_specs=[layer_spec(attention=attention)] * arch.num_layers,
                                          layer_norm=None)
        self.decoder = TransformerBlock(config=config, spec=spec, post_layer_norm=False)
        self.final_layer = _FinalLayer(config, h, p * p * arch.out_channels)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """DiT's initialisation for the modules outside megatron's layers (those get xavier-uniform weights and
        zero biases from the config; their adaLN modulations are zero): patch embedding xavier on the flattened
        kernel, embedders N(0, 0.02), final layer zero."""
        w = self.patch_embed.weight
        torch.nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        torch.nn.init.zeros_(self.patch_embed.bias)
        for lin in (self.t_embedder.linear_1, self.t_embedder.linear_2):
            torch.nn.init.normal_(lin.weight, std=0.02)
            torch.nn.init.zeros_(lin.bias)
        torch.nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        torch.nn.init.zeros_(self.final_layer.linear.weight)
        torch.nn.init.zeros_(self.final_layer.linear.bias)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """megatron's schedules call this on every model (it matters only for pipeline stages after the first)."""
        self.decoder.set_input_tensor(input_tensor[0] if isinstance(input_tensor, list) else input_tensor)

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, _, height, width = latents.shape
        p = self.arch.patch_size
        x = self.patch_embed(latents).flatten(2).transpose(1, 2)  # [b, T, h]
        x = (x + self.pos_embed.to(x.dtype)).transpose(0, 1).contiguous()  # [T, b, h]: megatron's layout
        c = (self.t_embedder(timesteps) + self.y_embedder(labels)).unsqueeze(0)  # [1, b, h]
        x = self.decoder(hidden_states=x, attention_mask=None, context=c)
        x = self.final_layer(x, c).transpose(0, 1)  # [b, T, p*p*out]
        gh, gw = height // p, width // p
        x = x.reshape(b, gh, gw, p, p, -1).permute(0, 5, 1, 3, 2, 4)  # [b, out, gh, p, gw, p]
        return x.reshape(b, -1, gh * p, gw * p)


def build_dit(*, config: Any, arch: Any, device: torch.device, attention: str = "sdpa",
              compile_mode: str | None = None) -> list[torch.nn.Module]:
    """``[DiTModel]`` for this rank, before DDP (one chunk: no pipeline parallelism). ``compile_mode`` (``"default"`` or
    another ``torch.compile`` mode) compiles each transformer layer, as torchtitan compiles per block: one graph
    serves every layer, and megatron's DDP hooks and recompute stay outside it."""
    model = DiTModel(config, arch, attention=attention)
    model.model_type = ModelType.encoder_or_decoder  # NOTE: megatron's schedules read it
    model.to(device=device, dtype=config.params_dtype)
    if compile_mode is not None:
        for layer in model.decoder.layers:
            layer.compile(mode=None if compile_mode == "default" else compile_mode)
    return [model]


def noise_scheduler():
    """DDPM with linear betas over 1000 steps (DiT's training schedule), diffusers' implementation."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear")


def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of squared errors and element count (megatron's per-token loss convention: the step divides by the
    global count, so the loss is the MSE over the whole global batch whatever the layout)."""
    total = output_tensor.sum()
    count = torch.tensor(output_tensor.numel(), dtype=torch.int, device=output_tensor.device)
    return total, count, {LOSS_KEY: torch.stack([total.detach(), count.detach().float()])}


def _posterior_tables(scheduler: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The DDPM posterior q(x_{t-1} | x_t, x_0) per timestep, in float64 (Ho et al. eq. 6-7; the log variance
    clipped at t = 0 to its t = 1 value, as Improved DDPM / DiT do), cached on the scheduler per device."""
    cache = scheduler.__dict__.setdefault("_loongforge_posterior", {})
    if device not in cache:
        betas = scheduler.betas.double()
        ac = torch.cumprod(1.0 - betas, 0)
        ac_prev = torch.cat([ac.new_ones(1), ac[:-1]])
        var = betas * (1.0 - ac_prev) / (1.0 - ac)
        cache[device] = {k: v.to(device) for k, v in {
            "log_var": torch.log(torch.cat([var[1:2], var[1:]])), "log_beta": torch.log(betas),
            "coef_x0": betas * ac_prev.sqrt() / (1.0 - ac), "coef_xt": (1.0 - ac_prev) * (1.0 - betas).sqrt() / (1.0 - ac),
            "recip_ac": (1.0 / ac).sqrt(), "recipm1_ac": (1.0 / ac - 1.0).sqrt()}.items()}
    return cache[device]


def _std_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of the standard normal CDF (what Improved DDPM's decoder likelihood uses)."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def variational_bound(x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor, eps: torch.Tensor,
                      var_out: torch.Tensor, scheduler: Any) -> torch.Tensor:
    """Per-sample L_vlb term of the hybrid objective (Nichol & Dhariwal 2021, used by DiT), in bits per dimension.

    The model's variance interpolates in log space between the posterior variance and beta_t with
    ``(var_out + 1) / 2``; its mean comes from the *detached* noise prediction ``eps``, so this term trains only the
    variance. t > 0: KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)); t = 0: the discretized Gaussian decoder NLL
    (bins of 2/255 on [-1, 1], Improved DDPM's definition, which DiT applies to its latents as well)."""
    tab = _posterior_tables(scheduler, x0.device)

    def at(name: str) -> torch.Tensor:
        return tab[name][t].view(-1, *([1] * (x0.dim() - 1)))

    x0, xt, eps, v = x0.double(), xt.double(), eps.detach().double(), var_out.double()
    frac = (v + 1.0) / 2.0
    log_var = frac * at("log_beta") + (1.0 - frac) * at("log_var")
    mean = at("coef_x0") * (at("recip_ac") * xt - at("recipm1_ac") * eps) + at("coef_xt") * xt
    true_mean, true_log_var = at("coef_x0") * x0 + at("coef_xt") * xt, at("log_var")
    kl = 0.5 * (-1.0 + log_var - true_log_var + torch.exp(true_log_var - log_var)
                + (true_mean - mean).pow(2) * torch.exp(-log_var))
    centered, inv_std = x0 - mean, torch.exp(-0.5 * log_var)
    cdf_plus = _std_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_minus = _std_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_probs = torch.where(
        x0 < -0.999, torch.log(cdf_plus.clamp(min=1e-12)),
        torch.where(x0 > 0.999, torch.log((1.0 - cdf_minus).clamp(min=1e-12)),
                    torch.log((cdf_plus - cdf_minus).clamp(min=1e-12))))
    dims = tuple(range(1, x0.dim()))
    per_sample = torch.where(t == 0, -log_probs.mean(dims), kl.mean(dims)) / math.log(2.0)
    return per_sample.float()


def forward_step(data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module, *, scheduler: Any,
                 encoder: Any = None):
    """megatron's ``forward_step_func`` for DiT: the DDPM epsilon-prediction objective.

    The batch holds clean latents (or images for ``encoder`` to encode), the noise, the timesteps and the labels
    (null class where classifier-free-guidance dropout struck), all drawn per sample by the dataset so resume is
    exact. ``x_t = scheduler.add_noise(x_0, noise, t)``; the loss is the MSE between the predicted and the true
    noise. A model that also predicts the variance (``out_channels = 2 * in_channels``, DiT's ``learn_sigma``, as
    facebook/DiT-XL-2-256) trains it with DiT's hybrid objective: MSE + :func:`variational_bound` (per sample,
    added to each of its elements so megatron's sum / count gives mean MSE + mean L_vlb over the global batch).
    """
    param = next(model.parameters())
    batch = _to_device(next(data_iterator), param.device)
    latents = batch["latents"] if "latents" in batch else encoder(batch)
    noise, timesteps = batch["noise"], batch["timesteps"]
    noisy = scheduler.add_noise(latents, noise, timesteps)
    pred = model(noisy.to(param.dtype), timesteps, batch["labels"])
    c = noise.shape[1]
    per_element = (pred[:, :c].float() - noise.float()).pow(2)
    if pred.shape[1] == 2 * c:
        vb = variational_bound(latents, noisy, timesteps, pred[:, :c], pred[:, c:], scheduler)
        per_element = per_element + vb.view(-1, *([1] * (per_element.dim() - 1)))
    return per_element, loss_func
