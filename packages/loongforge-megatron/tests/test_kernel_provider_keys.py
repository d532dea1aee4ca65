"""``kernels.provider`` on the megatron backend is checked at validate: a provider must serve every op of our spec
(an explicit provider is never swapped for another at build), and it is refused where nothing uses it."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongforge.cli import main

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
LLM = RECIPES / "llm" / "tiny" / "llama_tiny.yaml"


@pytest.mark.parametrize(("recipe", "overrides", "fragment"), [
    (LLM, ["kernels.provider=tilelang"], "provider 'tilelang' has no rms_norm, swiglu, rope"),
    (LLM, ["kernels.provider=torch", "kernels.layers=local"], "kernels.layers 'local' uses none"),
    (RECIPES / "diffusion" / "dit_tiny.yaml", ["kernels.provider=triton"], "DiT models use no fused kernels"),
])
def test_unusable_providers_are_refused(recipe, overrides, fragment, capsys):
    assert main(["validate", str(recipe), *overrides]) == 2
    err = capsys.readouterr().err
    assert "key 'kernels.provider'" in err and fragment in err and err.count("\n") == 1, err


@pytest.mark.parametrize("provider", ["auto", "torch", "triton"])
def test_full_providers_are_accepted(provider, capsys):
    assert main(["validate", str(LLM), f"kernels.provider={provider}"]) == 0, capsys.readouterr().err


def test_the_old_kernels_spec_name_is_read_with_a_notice(monkeypatch, capsys):
    """``kernels.spec`` (the old name of ``kernels.layers``) still selects the layers, with a one-line notice; giving
    both names is refused naming the section."""
    import loongforge
    from loongforge_megatron import config

    monkeypatch.setattr(config, "_SPEC_NOTICE_SHOWN", False)
    assert loongforge.load_recipe(LLM, ["kernels.spec=local"]).kernels.layers == "local"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kernels.spec is renamed kernels.layers" in err, err
    assert main(["validate", str(LLM), "kernels.spec=local", "kernels.layers=local"]) == 2
    err = capsys.readouterr().err
    assert "key 'kernels'" in err and "give only kernels.layers" in err and err.count("\n") == 1, err
