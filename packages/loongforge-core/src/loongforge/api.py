"""The public Python API: everything the CLI does, as documented calls.

Example::

    import loongforge

    recipe = loongforge.load_recipe("recipes/quickstart/llama_stdlib.yaml", ["train.steps=20"])
    metrics = loongforge.train(recipe, output_dir="runs/nb")          # one process, in this process
    job, runtime = loongforge.build_job(recipe, output_dir="runs/nb2")  # or drive it step by step
    for _ in range(3):
        print(job.step()["loss"])
    job.close()
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loongforge.backend import Job, get_backend
from loongforge.errors import LaunchError, LoongForgeError, RecipeError
from loongforge.failures import FAILED
from loongforge.launcher import LaunchConfig, launch
from loongforge.recipe import Recipe, dump_recipe, load_recipe
from loongforge.runtime import Runtime

__all__ = ["build_job", "default_output_dir", "load_recipe", "run_in_process", "train", "write_run_recipe"]


def validate_for(recipe: Recipe, *, world_size: int, file: str | Path | None = None) -> None:
    """The backend's validation for ``world_size`` processes; its errors name the recipe file."""
    from loongforge.errors import ParallelPlanError

    try:
        get_backend(recipe.backend).validate(recipe, world_size=world_size)
    except ParallelPlanError as exc:
        if file is None:
            raise
        raise ParallelPlanError(f"{file}: parallel layout: {exc}") from None
    except RecipeError as exc:
        if file is None or exc.file is not None:
            raise
        raise RecipeError(exc.message, key=exc.key, file=str(file)) from None


def default_output_dir(recipe_path: str | Path | None, root: str | Path = "runs") -> Path:
    """``runs/<recipe stem>-<YYYYmmdd-HHMMSS>``, created here so that it is this run's own: a run started in the
    same second (or a directory already there) gets ``-2``, ``-3``, ... (claimed with an exclusive mkdir, so two
    processes cannot both take one name and append to each other's metrics and checkpoints)."""
    stem = Path(recipe_path).stem if recipe_path else "run"
    base = Path(root) / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 10_000):
        out = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            Path(root).mkdir(parents=True, exist_ok=True)
            out.mkdir()
            return out
        except FileExistsError:
            if not Path(root).is_dir():
                return out  # NOTE: the caller's output check names the unusable path in one line
        except OSError:
            return out
    raise LoongForgeError(f"{base}: no free run directory name (10,000 taken); pass --output")


def _check_output_dir(out: Path) -> None:
    """The run directory exists or can be made, as a directory (one line naming it, not an internal error later)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        what = "is a file" if out.is_file() else f"cannot be created ({exc.strerror or exc})"
        raise LoongForgeError(f"--output '{out}' {what}; give a run directory that can be written") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise LoongForgeError(f"--output '{out}' is not writable; give a run directory that can be written")


def previous_run_step(recipe: Recipe, out: Path) -> int | None:
    """The step ``out``'s latest checkpoint holds when this recipe would resume from it (None: a fresh start).
    A checkpoint past ``train.steps`` is refused with one line: the run would do nothing, or go backwards."""
    if recipe.checkpoint.resume != "auto":
        return None
    from loongforge.checkpoint.atomic import checkpoint_step, latest_checkpoint
    from loongforge.errors import CheckpointError

    try:
        step = checkpoint_step(latest_checkpoint(out / "checkpoints") or "")
    except CheckpointError:
        return None  # NOTE: the backend's resume reports a broken checkpoint directory with its own message
    if step is not None and step > recipe.train.steps:
        raise RecipeError(f"{step:,} steps are done in {out / 'checkpoints'}, more than train.steps ({recipe.train.steps:,}):"
                          f" raise train.steps above {step:,} to train further, or use another --output",
                          key="train.steps")
    return step


def write_run_recipe(recipe: Recipe, output_dir: str | Path, *, name: str = "recipe.yaml") -> Path:
    """Write the fully resolved recipe to ``OUTPUT/recipe.yaml`` (atomically)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(dump_recipe(recipe))
    tmp.replace(path)
    return path


def build_job(recipe: Recipe, *, output_dir: str | Path) -> tuple[Job, Runtime]:
    """Create this process's runtime and let the recipe's backend build the job (model, data, optimizer)."""
    backend = get_backend(recipe.backend)
    runtime = Runtime.create(recipe, output_dir)
    backend.validate(recipe, world_size=runtime.world_size)
    return backend.build(recipe, runtime), runtime


def run_in_process(recipe: Recipe, *, output_dir: str | Path, write_recipe: bool = True) -> dict[str, Any]:
    """Train ``recipe`` in this process (one rank of a launched job, or the whole job when world size is 1)."""
    job, runtime = build_job(recipe, output_dir=output_dir)
    if write_recipe:  # NOTE: after the build: a recipe that cannot build or resume here leaves RUN/recipe.yaml alone
        write_run_recipe(recipe, output_dir)
    try:
        return job.run()
    finally:
        job.close()
        if runtime.logger is not None:
            runtime.logger.close()


def train(
    recipe: Recipe | str | Path,
    *,
    output_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    launch_config: LaunchConfig | None = None,
    source: str | Path | None = None,
    rerun: bool = False,
) -> dict[str, Any]:
    """Train a recipe (object or path). One process runs here; more go through the elastic launcher. The result
    holds ``output_dir``; without one given, ``runs/<recipe file stem>-<time>`` (``source``: the file a Recipe
    object was loaded from). An ``output_dir`` whose checkpoint already holds ``train.steps`` is a finished run:
    it is reported and left as it is (result ``finished: True``) unless ``rerun`` (resume, save, export again)."""
    path = source
    if not isinstance(recipe, Recipe):
        path = recipe
        recipe = load_recipe(recipe, overrides)
    elif overrides:
        raise LoongForgeError("overrides apply to recipe files; pass a path or override the Recipe object")
    config = launch_config or LaunchConfig(nproc=recipe.parallel.min_world_size())
    config.check()
    world = config.nproc * config.min_nodes
    validate_for(recipe, world_size=world, file=path)
    # NOTE: a default run directory is claimed (created) only once the launch and the recipe are known to be good
    done = previous_run_step(recipe, Path(output_dir)) if output_dir else None
    if done is not None and done == recipe.train.steps and not rerun:
        print(f"{output_dir}: this run already finished (its checkpoint holds all {done:,} train.steps); nothing "
              "to do. Raise train.steps to train further, or pass --rerun to save and export again", file=sys.stderr)
        return {"output_dir": str(output_dir), "finished": True}
    out = Path(output_dir) if output_dir else default_output_dir(path)
    _check_output_dir(out)
    if config.single_process or str(config.nnodes) == "1":
        # fail here with one line (not once per worker) when the device or its runtime is missing
        from loongforge.accelerator import get_accelerator

        get_accelerator(recipe.accelerator.name, options=recipe.accelerator.options, env=recipe.accelerator.env)
    if config.single_process:
        return {**run_in_process(recipe, output_dir=out), "output_dir": str(out)}
    recipe_file = write_run_recipe(recipe, out, name="recipe.launch.yaml")  # rank 0 writes recipe.yaml once built
    for stale in out.glob(f"{FAILED}.*"):
        stale.unlink(missing_ok=True)
    code = launch(config, recipe_file=recipe_file, output_dir=out)
    if code != 0:
        raise LaunchError(f"training failed on one of {world} processes (exit code {code}); see the messages above",
                          exit_code=code)
    return {"output_dir": str(out)}
