"""Build tiny megatron-core GPTModels (local spec, TP=1, CPU, one gloo process) from the family's arch of the HF
config and our TransformerConfig translation (what training builds) and print ``{family: {param name: shape}}`` as JSON. Run as a subprocess so torch.distributed state stays out of
the test process. Usage: python _megatron_probe.py CONFIGS.json OUT.json"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
# NOTE: MLA's rotary embeddings call torch.cuda.current_device() even with use_cpu_initialization.
torch.cuda.current_device = lambda: "cpu"


def build(family: str, hf: dict) -> dict[str, list[int]]:
    from loongforge.checkpoint import padded_vocab_size
    from loongforge.parallel.plan import ParallelPlan
    from loongforge_megatron.models.gpt.translate import transformer_config
    from loongforge_megatron.models.registry import get_family
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    arch = get_family(family).arch_from_hf(hf, path=Path("config.json"))
    # NOTE: the allgather dispatcher: alltoall's asks for a CUDA stream (the job runs it under the CPU adaptations)
    config = transformer_config(arch, plan=ParallelPlan(world_size=1), precision="fp32", cpu_init=True,
                                moe_dispatcher="allgather")
    mla = arch.is_mla

    class NoAttention(torch.nn.Module):  # NOTE: local DotProductAttention rejects MLA's k_channels kwarg
        def __init__(self, *args, **kwargs):
            super().__init__()

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        attn = layer.submodules.self_attention
        if mla:
            attn.submodules.core_attention = ModuleSpec(module=NoAttention)
            if arch.q_lora_rank is None:
                attn.submodules.q_layernorm = IdentityOp
    model = GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, divisible_by=128, tp_size=1),
        max_sequence_length=arch.max_position_embeddings, position_embedding_type="rope",
        share_embeddings_and_output_weights=arch.tie_embeddings,
    )
    return {k: list(v.shape) for k, v in model.state_dict().items() if "_extra_state" not in k}


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    configs = json.loads(open(sys.argv[1]).read())
    out = {name: build(fam, hf) for name, (fam, hf) in configs.items()}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
