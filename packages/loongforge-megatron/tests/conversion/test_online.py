from __future__ import annotations

import pytest
import torch
from loongforge.checkpoint import SafetensorsReader
from loongforge_megatron.conversion import (
    MegatronLayout,
    gather_to_hf,
    gather_to_hf_dir,
    hf_to_megatron,
    shard_state_dict_for_rank,
)


@pytest.mark.parametrize("family,tp,pp,ep,vpp", [("qwen3_moe", 2, 2, 2, 1), ("deepseek_v3", 2, 1, 2, 1),
                                                 ("llama", 2, 2, 1, 2)])
def test_online_rank_shards_equal_offline_and_gather_back(tiny_hf, tmp_path, family, tp, pp, ep, vpp):
    src = tiny_hf(family)
    layout = hf_to_megatron(src, tmp_path / "mg", tp=tp, pp=pp, ep=ep, vpp=vpp)
    per_rank = {}
    for rank in layout.ranks():
        t, p, e, v = rank
        sd = shard_state_dict_for_rank(src, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, ep_rank=e, ep_size=ep,
                                       vpp_rank=v, vpp_size=vpp)
        offline = SafetensorsReader(layout.rank_file(tmp_path / "mg", rank))
        assert sorted(sd) == sorted(offline.keys())
        assert all(torch.equal(sd[k], offline.get(k)) for k in sd)
        per_rank[rank] = sd
    hf = SafetensorsReader(src)
    got = gather_to_hf(per_rank, hf_config=layout.hf_config, tp=tp, pp=pp, ep=ep, vpp=vpp)
    assert sorted(got) == sorted(hf.keys())
    assert all(torch.equal(got[k], hf.get(k)) for k in got)
    out = gather_to_hf_dir(per_rank, tmp_path / "hf", hf_config=layout.hf_config, tp=tp, pp=pp, ep=ep, vpp=vpp,
                           assets_from=src)
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    back = SafetensorsReader(out)
    assert all(torch.equal(back.get(k), hf.get(k)) for k in hf.keys())


def test_online_casts_dtype(tiny_hf):
    sd = shard_state_dict_for_rank(tiny_hf("llama"), tp_rank=1, tp_size=2, dtype=torch.bfloat16)
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}


def test_layout_json_roundtrip(tiny_hf, tmp_path):
    layout = hf_to_megatron(tiny_hf("deepseek_v3"), tmp_path / "mg", tp=2, ep=2)
    loaded = MegatronLayout.load(tmp_path / "mg")
    assert loaded == layout and loaded.etp == 2 and loaded.padded_vocab_size == 256
    from loongforge.parallel.plan import ParallelPlan
    from loongforge_megatron.models.gpt.translate import transformer_config
    from loongforge_megatron.models.registry import get_family

    # NOTE: the layout names the family; its spec gives the megatron config (one translation, training's)
    arch = get_family(loaded.family).arch_from_hf(loaded.hf_config, path=tmp_path / "mg")
    config = transformer_config(arch, plan=ParallelPlan(world_size=1), precision="fp32", cpu_init=True)
    assert config.multi_latent_attention is True
