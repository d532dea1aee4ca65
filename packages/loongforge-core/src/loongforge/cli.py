"""The ``loongforge`` command line. Every user error exits with code 2 and one line on stderr."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from loongforge.errors import LoongForgeError


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an argument's help where X says something (not None / False / [])."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if (d is None or d is False or d is argparse.SUPPRESS or d == [] or "default" in text.lower()
                or text == argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with :class:`HelpFormatter`; subparsers (plugin commands' too) inherit both."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def version_text() -> str:
    """``loongforge --version``: every installed LoongForge distribution (core and its plugins) and torch."""
    from importlib import metadata

    from loongforge import __version__, registry

    dists = sorted(set().union(*(reg.distributions() for reg in registry.REGISTRIES.values()))
                   - {"loongforge-core", "<unknown>"})
    parts = []
    for name in [*dists, "torch"]:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return f"loongforge {__version__}" + (f" ({', '.join(parts)})" if parts else "")


class _VersionAction(argparse.Action):
    """Like argparse's ``version`` action, but the text (a metadata scan) is made only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help=kwargs.get("help"))

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch (torchrun's flags)")
    g.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=None,
                   help="processes per node (default: tp*pp*cp*dp of the recipe)")
    g.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic jobs")
    g.add_argument("--node-rank", type=int, default=0, help="this node's rank among --nnodes")
    g.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    g.add_argument("--rdzv-backend", default="c10d", help="torch.distributed rendezvous backend")
    g.add_argument("--rdzv-id", default=None, help="job id shared by every node's launcher")
    g.add_argument("--max-restarts", type=int, default=0, help="restart failed workers this many times")


RECIPE_HELP = "recipe file, or a name `loongforge recipes` lists (e.g. llm/tiny/llama_tiny.yaml)"
CORE_COMMANDS = ("train", "validate", "recipes", "plugins", "plot", "data")


def _add_plugin_commands(sub: argparse._SubParsersAction, wanted: str | None) -> None:
    """Commands from the ``loongforge.commands`` entry-point group (a backend's ``convert``, ``place-experts``,
    ...). Only ``wanted``'s module is imported when a plugin command is asked for by name; the help imports all."""
    from loongforge import registry
    from loongforge.errors import PluginError

    keys = [k for k in registry.commands.keys() if k not in CORE_COMMANDS]
    for key in [wanted] if wanted in keys else ([] if wanted in CORE_COMMANDS else keys):
        try:
            registry.commands.get(key)(sub)
        except PluginError:
            if key == wanted:
                raise
            # NOTE: a broken plugin leaves the other commands usable; ``loongforge plugins`` shows why it failed


def build_parser(wanted: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; ``wanted``: the command asked for (None: every command, for the help)."""
    parser = ArgumentParser(prog="loongforge", description="Train LLMs, VLMs, diffusion and embodied models from YAML recipes.")
    parser.add_argument("--version", action=_VersionAction, help="print the installed LoongForge packages' versions")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", help="train a recipe")
    p.add_argument("recipe", help=RECIPE_HELP)
    p.add_argument("overrides", nargs="*", default=[], help="a.b.c=value overrides")
    p.add_argument("--output", "-o", default=None, help="run directory (default: runs/<recipe>-<time>)")
    p.add_argument("--rerun", action="store_true",
                   help="train again into an --output whose run already finished (it resumes, saves and exports "
                        "again); without it such a run is reported and left as it is")
    _add_launch_args(p)

    p = sub.add_parser("validate", help="validate a recipe (and print it fully resolved with --show)")
    p.add_argument("recipe", help=RECIPE_HELP)
    p.add_argument("overrides", nargs="*", default=[], help="a.b.c=value overrides")
    p.add_argument("--show", action="store_true",
                   help="print the resolved recipe: every default, and what the backend derives (a preset's sizes)")
    p.add_argument("--world-size", type=int, default=None, help="check the parallel plan for this many processes")

    p = sub.add_parser("recipes", help="list shipped recipes (names that train / validate accept)")
    p.add_argument("--dir", default=None, help="folder to list (default: $LOONGFORGE_RECIPES, else ./recipes, "
                   "else the checkout's recipes/)")

    sub.add_parser("plugins", help="list installed backends, accelerators, kernel providers and commands")

    p = sub.add_parser("plot", help="write a PNG of a run's loss and throughput")
    p.add_argument("run", help="a run directory (holds metrics.jsonl)")
    p.add_argument("--output", "-o", default=None, help="PNG path (default: RUN/plot.png)")

    p = sub.add_parser("data", help="data preparation")
    dsub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    dp = dsub.add_parser("prepare", help="prepare the data a recipe's data section describes")
    dp.add_argument("recipe", help=RECIPE_HELP)
    dp.add_argument("overrides", nargs="*", default=[], help="a.b.c=value overrides")
    dp.add_argument("--force", action="store_true", help="rebuild even if the prepared data exists")

    _add_plugin_commands(sub, wanted)
    return parser


def find_recipe(name: str) -> str:
    """``name`` itself when it is a file, else the shipped recipe of that name (what ``loongforge recipes``
    prints: relative to its recipes folder), else ``name`` (the loader then says "file not found")."""
    if Path(name).is_file():
        return name
    from loongforge.recipes_index import recipes_root

    root = recipes_root()
    if root is not None and not Path(name).is_absolute() and (root / name).is_file():
        return str(root / name)
    return name


def _cmd_train(args: argparse.Namespace) -> int:
    from loongforge.api import train
    from loongforge.launcher import LaunchConfig
    from loongforge.recipe import load_recipe

    args.recipe = find_recipe(args.recipe)
    recipe = load_recipe(args.recipe, args.overrides)
    nproc = args.nproc if args.nproc is not None else recipe.parallel.min_world_size()
    config = LaunchConfig(nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                          rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id, max_restarts=args.max_restarts)
    # NOTE: train() claims the default run directory (runs/<recipe>-<time>[-N]) only after its checks
    result = train(recipe, output_dir=args.output, launch_config=config, source=args.recipe, rerun=args.rerun)
    print(f"run directory: {result['output_dir']}", file=sys.stderr)
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from loongforge.api import validate_for
    from loongforge.backend import get_backend
    from loongforge.recipe import dump_recipe, load_recipe

    args.recipe = find_recipe(args.recipe)
    recipe = load_recipe(args.recipe, args.overrides)
    world = args.world_size if args.world_size is not None else recipe.parallel.min_world_size()
    if world < 1:
        raise LoongForgeError(f"--world-size must be at least 1 (got {world})")
    validate_for(recipe, world_size=world, file=args.recipe)
    if args.show:
        sys.stdout.write(dump_recipe(recipe, data=get_backend(recipe.backend).resolved(recipe)))
    else:
        print(f"ok: {args.recipe} (backend {recipe.backend}, world size {world})")
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from loongforge.recipes_index import list_recipes, recipes_root

    root = Path(args.dir) if args.dir else recipes_root()
    rows = list_recipes(root)
    if not rows:
        print("no recipes found (set LOONGFORGE_RECIPES or run from a checkout)")
        return 0
    width = max(len(str(p.relative_to(root))) for p, _, _ in rows)
    for path, backend, desc in rows:
        print(f"{str(path.relative_to(root)):<{width}}  [{backend}]  {desc}")
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from loongforge import registry

    for group, reg in registry.REGISTRIES.items():
        print(group)
        entries = reg.entries()
        if not entries:
            print("  (none)")
        for e in entries:
            status = "ok"
            if e.error:
                status = f"failed to load: {e.error}"
            elif group == "loongforge.accelerators":
                try:
                    reason = e.obj.unavailable_reason()
                except Exception as exc:  # a plugin's probe must not crash the listing
                    reason = f"{type(exc).__name__}: {exc}"
                status = f"unavailable: {reason}" if reason else "available"
            elif group == "loongforge.kernels":
                try:  # NOTE: a provider's availability depends on the device: show it for the one here
                    from loongforge.accelerator.cuda import CudaAccelerator

                    device_type = "cuda" if CudaAccelerator.unavailable_reason() is None else "cpu"
                    reason = e.obj().unavailable_reason(device_type)
                except Exception as exc:  # a provider's probe must not crash the listing
                    device_type, reason = "?", f"{type(exc).__name__}: {exc}"
                status = f"unavailable on {device_type}: {reason}" if reason else f"available on {device_type}"
            print(f"  {e.key:<12} {e.distribution:<22} {e.value}  [{status}]")
        for key, dists in reg.duplicates().items():
            print(f"  {key:<12} DUPLICATE: registered by {' and '.join(dists)}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from loongforge.plot import plot_run

    print(plot_run(args.run, args.output))
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    if args.data_command != "prepare":
        raise LoongForgeError("usage: loongforge data prepare RECIPE [overrides]")
    from loongforge.backend import get_backend
    from loongforge.recipe import load_recipe

    recipe = load_recipe(find_recipe(args.recipe), args.overrides)
    path = get_backend(recipe.backend).prepare_data(recipe, force=args.force)
    print(f"prepared: {path}")
    return 0


COMMANDS = {
    "train": _cmd_train,
    "validate": _cmd_validate,
    "recipes": _cmd_recipes,
    "plugins": _cmd_plugins,
    "plot": _cmd_plot,
    "data": _cmd_data,
}


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; user errors print ``error: ...`` on one line and return 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(first)
    except LoongForgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    # NOTE: overrides may follow options (``train R --output D a.b=1``); argparse leaves those in ``extra``.
    stray = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    if not args.command:
        parser.print_help()
        return 2
    try:
        handler = getattr(args, "handler", None) or COMMANDS[args.command]
        return handler(args)
    except LoongForgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `loongforge recipes | head -1`: the reader left, nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # NOTE: so the interpreter's final flush does not fail again
        return 0
    except Exception as exc:
        if os.environ.get("LOONGFORGE_DEBUG"):
            raise
        print(f"internal error: {type(exc).__name__}: {exc} (set LOONGFORGE_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    except BaseException as exc:  # NOTE: e.g. torch DCP's CheckpointException derives from BaseException
        if isinstance(exc, SystemExit | GeneratorExit) or os.environ.get("LOONGFORGE_DEBUG"):
            raise
        first = next((line for line in str(exc).splitlines() if line.strip()), "")[:300]
        print(f"internal error: {type(exc).__name__}: {first} (set LOONGFORGE_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
