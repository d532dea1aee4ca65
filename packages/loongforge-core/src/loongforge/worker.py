"""Entry point of one training process started by the elastic launcher (``python -m loongforge.worker``)."""

from __future__ import annotations

import argparse
import sys

from loongforge.errors import LoongForgeError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loongforge.worker")
    parser.add_argument("--recipe", required=True, help="resolved recipe (RUN/recipe.yaml)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    from loongforge.api import load_recipe, run_in_process

    try:
        recipe = load_recipe(args.recipe)
        run_in_process(recipe, output_dir=args.output, write_recipe=False)
    except LoongForgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
