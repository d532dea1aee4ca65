"""Static expert placement: the plan balances EP ranks (keeping routing groups intact), and the renumbered HF
checkpoint computes exactly what the original does (transformers' logits), through ``loongforge place-experts``."""

from __future__ import annotations

import json

import pytest
import torch
from loongforge.cli import main
from loongforge_megatron.moe_placement import plan_layer, rank_imbalance


def test_plan_balances_ranks_and_is_a_permutation():
    loads = [100, 90, 80, 70, 10, 9, 8, 7]  # contiguous placement: rank 0 = 340, rank 1 = 34
    order = plan_layer(loads, ep=2)
    assert sorted(order) == list(range(8))
    assert rank_imbalance(loads, range(8), ep=2) == pytest.approx(340 / 187 - 1)
    assert rank_imbalance(loads, order, ep=2) < 0.03


def test_plan_keeps_routing_groups():
    loads = [100, 90, 80, 70, 10, 9, 8, 7]
    # 2 groups over 4 ranks: experts only move inside their group (group 0 = experts 0-3 stays on ranks 0-1)
    order = plan_layer(loads, ep=4, groups=2)
    assert sorted(order[:4]) == [0, 1, 2, 3] and sorted(order[4:]) == [4, 5, 6, 7]
    assert rank_imbalance(loads, order, ep=4) < rank_imbalance(loads, range(8), ep=4)
    # 4 groups over 2 ranks: whole groups move ({0,1}+{6,7} vs {2,3}+{4,5}), each group's experts stay together
    order = plan_layer(loads, ep=2, groups=4)
    pairs = {tuple(order[i:i + 2]) for i in range(0, 8, 2)}
    assert pairs == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert rank_imbalance(loads, order, ep=2) == pytest.approx(205 / 187 - 1)  # {190, 15} | {150, 19}: the best
    with pytest.raises(Exception, match="one must divide the other"):
        plan_layer(list(range(12)), ep=4, groups=3)


# deepseek_v3's tiny model has 2 routing groups of 2 experts; at ep=4 experts move only inside their group.
@pytest.mark.parametrize("family,loads,ep", [("qwen3_moe", [1000, 900, 10, 20], 2),
                                             ("deepseek_v3", [900, 1000, 20, 10], 4)])
def test_placed_checkpoint_computes_the_same_logits(tmp_path, tiny_hf, family, loads, ep, capsys):
    import transformers as tf

    src = tiny_hf(family, tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    n = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"]
    assert n == len(loads)
    skew = [[0] * n if i < cfg.get("first_k_dense_replace", 0) else loads for i in range(cfg["num_hidden_layers"])]
    (tmp_path / "loads.json").write_text(json.dumps({"tokens_per_expert": skew}))
    capsys.readouterr()
    dst = tmp_path / "placed"
    assert main(["place-experts", str(src), str(dst), "--loads", str(tmp_path / "loads.json"), "--ep", str(ep)]) == 0
    out = capsys.readouterr().out
    assert "imbalance" in out and (dst / "expert_placement.json").is_file()
    report = json.loads((dst / "expert_placement.json").read_text())
    for r in report["layers"].values():
        assert r["imbalance_after"] <= r["imbalance_before"] and r["order"] != list(range(n))
        if family == "qwen3_moe":
            assert r["imbalance_after"] < 0.1 < r["imbalance_before"]
    tokens = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for d in (src, dst):
        model = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=tokens).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)
    # a bad loads file is one line naming it
    (tmp_path / "bad.json").write_text("{}")
    capsys.readouterr()
    assert main(["place-experts", str(src), str(tmp_path / "x"), "--loads", str(tmp_path / "bad.json"), "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.json" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("content", [
    [1, 2], {"tokens_per_expert": 5}, {"tokens_per_expert": [None, [1, 2, 3, 4]]},
    {"tokens_per_expert": [["a", 2, 3, 4]] * 2}, {"tokens_per_expert": [[1, 2]] * 2},
    {"tokens_per_expert": [[1, 2, 3, 4, 5, 6]] * 2}, {"tokens_per_expert": [[1, 2, 3]] * 2},
    {"tokens_per_expert": [[1, -2, 3, 4]] * 2},
])
def test_malformed_loads_are_one_line_errors(tmp_path, tiny_hf, content, capsys):
    src = tiny_hf("qwen3_moe", tmp_path / "hf")
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    if isinstance(content, dict) and isinstance(content["tokens_per_expert"], list):
        content = {"tokens_per_expert": (content["tokens_per_expert"] * layers)[:layers]}
    (tmp_path / "loads.json").write_text(json.dumps(content))
    capsys.readouterr()
    code = main(["place-experts", str(src), str(tmp_path / "x"), "--loads", str(tmp_path / "loads.json"), "--ep", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "loads.json" in err and err.count("\n") == 1, err
