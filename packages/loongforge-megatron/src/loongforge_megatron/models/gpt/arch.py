"""The architecture of a decoder-only LM: the family-neutral numbers a preset or an HF config.json gives.

One :class:`Arch` describes Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3 (dense and MoE) and DeepSeek-V3-style (MLA +
MoE with shared experts) models. ``translate.py`` turns it into megatron-core's TransformerConfig and into an HF
config with each family's file (``llama.py`` ...), which also holds the family's published sizes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Arch(BaseModel):
    """Model shape. Fields left None are derived (head_dim = hidden / heads, kv heads = heads)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    family: str = Field("llama", description="the model family (a key of the loongforge.megatron.models registry)")
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    ffn_hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_query_groups: int | None = Field(None, ge=1, description="KV heads (GQA); default: num_attention_heads")
    head_dim: int | None = Field(None, ge=1)
    vocab_size: int = Field(ge=2)
    max_position_embeddings: int = Field(4096, ge=1)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling_factor: float | None = Field(None, gt=0, description="llama3-style rope scaling factor")
    rotary_percent: float = Field(1.0, gt=0, le=1, description="share of each head's dims RoPE rotates (the leading "
                                  "ones; GLM-4.5: 0.5, the HF config's partial_rotary_factor)")
    rope_original_max_position: int | None = Field(None, ge=1)
    rope_yarn: dict[str, float] | None = Field(
        None, description="YaRN scaling (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, "
        "mscale_all_dim; GPT families also truncate), as the HF config's rope_scaling: MLA through megatron's MLA, "
        "llama / qwen through megatron's GPT yarn embedding")
    sliding_window: int | None = Field(
        None, ge=1, description="the HF config's sliding attention window (Mistral; Qwen with use_sliding_window): "
        "megatron attends over the whole sequence here, so validate refuses a data.seq_length above it")
    max_window_layers: int | None = Field(
        None, ge=0, description="Qwen with use_sliding_window: layers from this index on use the window (kept for "
        "the HF export)")
    norm_eps: float = Field(1e-5, gt=0)
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    init_std: float = Field(0.02, gt=0)
    # MoE
    num_experts: int | None = Field(None, ge=1)
    moe_topk: int = Field(2, ge=1)
    moe_ffn_hidden_size: int | None = Field(None, ge=1)
    moe_shared_expert_ffn: int | None = Field(None, ge=1, description="total shared-expert intermediate size")
    moe_first_dense_layers: int = Field(0, ge=0, description="leading dense layers (DeepSeek first_k_dense_replace)")
    moe_norm_topk: bool = True
    moe_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_expert_bias: bool = False
    moe_routed_scaling: float | None = Field(None, gt=0)
    moe_num_groups: int | None = Field(None, ge=1)
    moe_group_topk: int | None = Field(None, ge=1)
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    # MoE routing options of training (megatron's router / dispatcher settings; not in HF configs)
    moe_aux_loss_type: Literal["aux_loss", "seq_aux_loss"] = Field(
        "aux_loss", description="load-balancing loss when moe_aux_loss_coeff > 0: over the micro-batch (aux_loss) "
        "or per sequence (seq_aux_loss, DeepSeek-V3's)")
    moe_z_loss_coeff: float | None = Field(None, gt=0, description="router z-loss weight (ST-MoE)")
    moe_expert_bias_update_rate: float = Field(1e-3, gt=0, description="aux-loss-free balancing (moe_expert_bias): "
                                               "how far each step moves an expert's bias toward equal load")
    moe_capacity_factor: float | None = Field(None, gt=0, description="expert capacity = factor x tokens x topk / "
                                              "experts; tokens over it are dropped (unset: dropless)")
    moe_token_drop_policy: Literal["probs", "position"] = Field(
        "probs", description="with moe_capacity_factor: drop the lowest-probability tokens, or the last ones")
    moe_pad_to_capacity: bool = Field(False, description="with moe_capacity_factor: pad every expert to capacity")
    moe_token_dispatcher: Literal["auto", "permute", "alltoall", "allgather"] = Field(
        "auto", description="permute: our fused moe_permute / moe_unpermute kernels, sync-free (all experts on one "
        "rank: ep 1, etp 1; not padded to capacity; grouped experts); alltoall / allgather: megatron's "
        "dispatchers; auto: permute where it applies, else alltoall")
    # multi-token prediction (DeepSeek-V3's MTP; megatron's mtp_num_layers)
    mtp_num_layers: int = Field(0, ge=0, description="multi-token-prediction depths trained after the decoder "
                                "(HF: the layers after num_hidden_layers); 0: none")
    mtp_loss_weight: float = Field(0.1, gt=0, description="weight of the MTP loss (averaged over depths) in the "
                                   "training loss: megatron's mtp_loss_scaling_factor")
    moe_shared_expert_overlap: bool = Field(
        False, description="run the shared experts on a side stream while the all-to-all dispatches the routed "
        "tokens (megatron's moe_shared_expert_overlap; needs shared experts and the alltoall dispatcher)")
    # MLA (DeepSeek)
    q_lora_rank: int | None = Field(None, ge=1)
    kv_lora_rank: int | None = Field(None, ge=1)
    qk_nope_head_dim: int | None = Field(None, ge=1)
    qk_rope_head_dim: int | None = Field(None, ge=1)
    v_head_dim: int | None = Field(None, ge=1)
    # DeepSeek Sparse Attention on MLA (the lightning indexer; HF index_n_heads / index_head_dim / index_topk)
    dsa_index_heads: int | None = Field(None, ge=1, description="lightning-indexer heads (unset: dense attention)")
    dsa_index_head_dim: int | None = Field(None, ge=1)
    dsa_index_topk: int | None = Field(None, ge=1, description="keys each query attends to under sparse attention")
    dsa_index_rope_interleaved: bool = Field(False, description="the indexer's RoPE pairs channels (0, 1), (2, 3) ... "
                                             "(GLM-5) instead of the two halves (DeepSeek-V3.2)")
    dsa_index_shared_layers: list[int] | None = Field(
        None, description="0-based layers without an indexer that reuse the previous indexer's top-k (GLM-5's "
        "indexer_types 'shared')")
    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def derived(self) -> dict[str, int | None]:
        """Fields left None that the architecture derives, as a recipe would spell them (``validate --show``)."""
        return {"num_query_groups": self.kv_heads, "head_dim": None if self.is_mla else self.kv_channels}

    @property
    def spec_name(self) -> str:
        """The registry key of the spec that trains this architecture."""
        return self.family

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @model_validator(mode="after")
    def _check(self) -> Arch:
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_query_groups ({self.kv_heads})"
            )
        if (self.moe_pad_to_capacity or self.moe_token_drop_policy != "probs") and self.moe_capacity_factor is None:
            raise ValueError("moe_pad_to_capacity / moe_token_drop_policy apply with moe_capacity_factor (token "
                             "dropping); set it or leave them out")
        if self.moe_expert_bias and self.moe_score_function != "sigmoid":
            raise ValueError("moe_expert_bias (aux-loss-free balancing) needs sigmoid router scores (megatron's "
                             f"rule); this model routes with {self.moe_score_function}")
        if self.moe_shared_expert_overlap and not (self.num_experts and self.moe_shared_expert_ffn):
            raise ValueError("moe_shared_expert_overlap overlaps the shared experts with the token dispatch; this "
                             "model has no shared experts (moe_shared_expert_ffn)")
        if self.moe_shared_expert_overlap and self.moe_token_dispatcher in ("permute", "allgather"):
            raise ValueError(f"moe_shared_expert_overlap needs the alltoall dispatcher (or auto), not "
                             f"moe_token_dispatcher {self.moe_token_dispatcher}")
        if self.num_experts and self.moe_topk > self.num_experts:
            raise ValueError(f"moe_topk ({self.moe_topk}) exceeds num_experts ({self.num_experts})")
        if self.dsa_index_heads and not (self.is_mla and self.q_lora_rank and self.dsa_index_head_dim
                                         and self.dsa_index_topk):
            raise ValueError("sparse attention (dsa_index_heads) needs MLA with q_lora_rank, dsa_index_head_dim and "
                             "dsa_index_topk")
        shared = self.dsa_index_shared_layers or []
        if shared and (0 in shared or not all(0 <= i < self.num_layers for i in shared)):
            raise ValueError(f"dsa_index_shared_layers {shared} must be layers 1..{self.num_layers - 1} (layer 0 "
                             "computes its own top-k)")
        if self.dsa_index_heads and self.dsa_index_head_dim < (self.qk_rope_head_dim or 0):
            raise ValueError(f"dsa_index_head_dim ({self.dsa_index_head_dim}) must hold the qk_rope_head_dim "
                             f"({self.qk_rope_head_dim}) channels RoPE rotates")
        if self.is_mla and not (self.qk_nope_head_dim and self.qk_rope_head_dim and self.v_head_dim):
            raise ValueError("MLA (kv_lora_rank set) needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
        return self

    def _attn_params(self) -> int:
        h = self.hidden_size
        if self.is_mla:
            q_head = (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)
            q = (h * self.q_lora_rank + self.q_lora_rank * self.num_attention_heads * q_head) if self.q_lora_rank else h * self.num_attention_heads * q_head
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * self.num_attention_heads * (
                self.qk_nope_head_dim + self.v_head_dim
            )
            return q + kv + self.num_attention_heads * self.v_head_dim * h
        d = self.kv_channels
        return h * d * (self.num_attention_heads + 2 * self.kv_heads) + self.num_attention_heads * d * h

    def num_params(self) -> int:
        """Parameter count (embeddings included; multi-token-prediction layers not), for logs and MFU."""
        h, layers = self.hidden_size, self.num_layers
        attn = self._attn_params()
        dense_mlp = 3 * h * self.ffn_hidden_size
        if self.is_moe:
            moe_layers = layers - self.moe_first_dense_layers
            expert = 3 * h * (self.moe_ffn_hidden_size or self.ffn_hidden_size)
            shared = 3 * h * (self.moe_shared_expert_ffn or 0)
            mlp = self.moe_first_dense_layers * dense_mlp + moe_layers * (self.num_experts * expert + shared + h * self.num_experts)
        else:
            mlp = layers * dense_mlp
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return layers * (attn + 2 * h) + mlp + emb + h

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token: 6 × active parameters (no embeddings) + 12 × layers × hidden × seq
        (attention scores and values, causal mask not discounted) — the PaLM/Megatron formula."""
        h = self.hidden_size
        active = self.num_params() - self.vocab_size * h * (1 if self.tie_embeddings else 2)
        if self.is_moe:
            moe_layers = self.num_layers - self.moe_first_dense_layers
            expert = 3 * h * (self.moe_ffn_hidden_size or self.ffn_hidden_size)
            active -= moe_layers * (self.num_experts - self.moe_topk) * expert
        attn_dim = self.num_attention_heads * (self.v_head_dim or self.kv_channels)
        flops = 6.0 * (active + self.vocab_size * h) + 12.0 * self.num_layers * attn_dim * seq_length
        if self.mtp_num_layers:
            # NOTE: each MTP depth: eh_proj + 3 norms, one decoder layer (MoE when the model has experts; its
            # active experts only) and the shared output layer again
            ffn = (self.moe_topk * 3 * h * (self.moe_ffn_hidden_size or self.ffn_hidden_size)
                   + 3 * h * (self.moe_shared_expert_ffn or 0) + h * (self.num_experts or 0)
                   if self.is_moe else 3 * h * self.ffn_hidden_size)
            depth = 2 * h * h + 5 * h + self._attn_params() + ffn + self.vocab_size * h
            flops += self.mtp_num_layers * (6.0 * depth + 12.0 * attn_dim * seq_length)
        return flops
