"""The fused output layer (``spec.output``): with the loss mask it returns the masked token-sum in one pass
(no recomputed logits in the backward), equal to the per-token path reduced by ``loss_func``.

NOTE: each test body runs in a rank with megatron's model-parallel state (``in_world``), never in pytest's
own process; its monkeypatch changes stay in that rank."""

from __future__ import annotations

import pytest
import torch


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    s, b, h, v = 11, 3, 16, 97
    hidden = torch.randn(s, b, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    labels = torch.randint(0, v, (b, s), generator=gen)
    mask = (torch.rand(b, s, generator=gen) > 0.3).float()
    return hidden, weight, labels, mask


def _loss_and_grads(processor, *, context, scale: float = 0.37):
    from loongforge_megatron.engine.step import loss_func

    hidden, weight, labels, mask = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    out = processor(hidden_states=hidden, output_layer=None, output_weight=weight, labels=labels,
                    compute_language_model_loss=None, provider="torch", context=mask if context else None)
    loss_sum, num_tokens, report = loss_func(mask, out)
    (loss_sum * scale).backward()
    return out, loss_sum.detach(), int(num_tokens), report["lm loss"], hidden.grad, weight.grad


def _masked_sum_in_one_pass_equals_per_token_path(*, monkeypatch):
    import loongforge_kernels.cross_entropy as ce
    from loongforge_megatron.layers.output import fused_output_processor

    calls = []
    real = ce._run_chunks
    monkeypatch.setattr(ce, "_run_chunks", lambda *a, **k: calls.append(1) or real(*a, **k))
    per_token = _loss_and_grads(fused_output_processor, context=False)
    assert per_token[0].shape == (3, 11) and len(calls) == 2  # forward, then the backward's recompute
    calls.clear()
    fused = _loss_and_grads(fused_output_processor, context=True)
    assert fused[0].dim() == 0 and len(calls) == 1  # the grads came from the forward pass
    assert fused[2] == per_token[2]
    for got, want, name in zip(fused[1:], per_token[1:], ("loss", "tokens", "report", "dhidden", "dweight"),
                               strict=True):
        if name != "tokens":
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_masked_sum_in_one_pass_equals_per_token_path(in_world, tmp_path, monkeypatch):
    in_world(_masked_sum_in_one_pass_equals_per_token_path, out=tmp_path, monkeypatch=monkeypatch)


def _op_without_token_weights_keeps_the_per_token_path(*, monkeypatch):
    from loongforge_kernels.cross_entropy import fused_linear_cross_entropy
    from loongforge_megatron.layers import output

    def plugin_op(hidden, weight, labels, ignore_index=-100, reduction="mean", *, process_group=None,
                  reduce_grad_input=True):
        return fused_linear_cross_entropy(hidden, weight, labels, ignore_index, reduction,
                                          process_group=process_group, reduce_grad_input=reduce_grad_input,
                                          impl="torch")

    monkeypatch.setattr(output, "kernel", lambda *a, **k: plugin_op)
    got = _loss_and_grads(output.fused_output_processor, context=True)
    want = _loss_and_grads(output.fused_output_processor, context=False)
    assert got[0].shape == (3, 11)
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[5], want[5])


def test_op_without_token_weights_keeps_the_per_token_path(in_world, tmp_path, monkeypatch):
    """A plugin's fused CE that predates ``token_weights`` still works (per-token losses, recomputing backward)."""
    in_world(_op_without_token_weights_keeps_the_per_token_path, out=tmp_path, monkeypatch=monkeypatch)


def _eval_under_no_grad(*, context, monkeypatch):
    import loongforge_kernels.cross_entropy as ce
    from loongforge_megatron.engine.step import loss_func
    from loongforge_megatron.layers.output import fused_output_processor

    calls = []
    real = ce._chunk_grads
    monkeypatch.setattr(ce, "_chunk_grads", lambda *a, **k: calls.append(1) or real(*a, **k))
    hidden, weight, labels, mask = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with torch.no_grad():
        out = fused_output_processor(hidden_states=hidden, output_layer=None, output_weight=weight, labels=labels,
                                     compute_language_model_loss=None, provider="torch",
                                     context=mask if context else None)
        loss_sum = loss_func(mask, out)[0]
    logits = hidden.transpose(0, 1) @ weight.t()
    want = (torch.nn.functional.cross_entropy(logits.reshape(-1, 97), labels.reshape(-1), reduction="none")
            * mask.reshape(-1)).sum()
    torch.testing.assert_close(loss_sum, want.detach(), rtol=1e-5, atol=1e-5)
    assert not calls


@pytest.mark.parametrize("context", [True, False], ids=["masked-sum", "per-token"])
def test_eval_under_no_grad(in_world, tmp_path, context, monkeypatch):
    """Eval runs under torch.no_grad on parameters that require grad: the loss is right and no grads are computed
    (``ctx.needs_input_grad`` is True under no_grad too)."""
    in_world(_eval_under_no_grad, out=tmp_path, context=context, monkeypatch=monkeypatch)


def _unhashable_plugin_op_and_a_one_element_sum(*, monkeypatch):
    from loongforge_kernels.cross_entropy import fused_linear_cross_entropy
    from loongforge_megatron.layers import output

    class PluginOp:
        __hash__ = None  # an eq-dataclass-like object

        def __call__(self, hidden, weight, labels, ignore_index=-100, reduction="mean", *, process_group=None,
                     reduce_grad_input=True, token_weights=None):
            return fused_linear_cross_entropy(hidden, weight, labels, ignore_index, reduction, impl="torch",
                                              process_group=process_group, reduce_grad_input=reduce_grad_input,
                                              token_weights=token_weights).reshape(1)

    monkeypatch.setattr(output, "kernel", lambda *a, **k: PluginOp())
    got = _loss_and_grads(output.fused_output_processor, context=True)
    monkeypatch.undo()
    want = _loss_and_grads(output.fused_output_processor, context=True)
    assert got[0].dim() == 0
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[5], want[5])


def test_unhashable_plugin_op_and_a_one_element_sum(in_world, tmp_path, monkeypatch):
    """A plugin op object that cannot be hashed is inspected uncached; a [1]-shaped sum becomes a scalar (the loss
    function tells a summed loss from per-token losses by its dimensions)."""
    in_world(_unhashable_plugin_op_and_a_one_element_sum, out=tmp_path, monkeypatch=monkeypatch)
