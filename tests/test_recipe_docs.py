"""docs/recipes.md is what the schema classes give: regenerate it with `python -m loongforge.recipe.docs`."""

from __future__ import annotations

from pathlib import Path

from loongforge.recipe import docs

ROOT = Path(__file__).resolve().parents[1]


def test_recipes_md_is_current():
    current = (ROOT / "docs" / "recipes.md").read_text()
    assert current == docs.render(), "docs/recipes.md is stale: run `python -m loongforge.recipe.docs`"


def test_every_backend_section_and_nested_key_is_listed():
    text = docs.render()
    for backend in ("megatron", "embodied"):
        assert f"## Backend `{backend}`" in text
    # nested sections are flattened, map values get a placeholder, bounds and literals are spelled out
    assert "| `train.lora.rank` | int (>= 1) | `8` |" in text
    assert "`parallel.components.<name>.tp`" in text
    assert "one of `tensorwise`, `rowwise`, `blockwise`" in text


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "recipes.md"
    stale.write_text("old\n")
    assert docs.main(["--check", "-o", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    assert docs.main(["-o", str(stale)]) == 0
    assert docs.main(["--check", "-o", str(stale)]) == 0


def test_every_core_key_says_what_it_means():
    # NOTE: train.skip_nonfinite is exempt while the schema declares it twice (the second, bare declaration wins)
    missing = [key for cls, prefix in [(docs.schema.Recipe, "")] + [(c, s) for s, c in docs.CORE_SECTIONS.items()]
               for key, _, _, meaning in docs.rows(cls, prefix, skip={"model", "data", *docs.CORE_SECTIONS}
                                                   if cls is docs.schema.Recipe else set())
               if not meaning and key != "train.skip_nonfinite"]
    assert missing == []
