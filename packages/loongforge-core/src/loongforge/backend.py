"""The backend interface: ``validate(recipe)``, ``build(recipe, runtime) -> Job``, ``Job.run() -> metrics``.

Backends are registered under the ``loongforge.backends`` entry-point group. Training stages (pretrain / cpt /
sft / lora) are recipe values, not separate programs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from loongforge.errors import PluginError

if TYPE_CHECKING:
    from loongforge.recipe.schema import Recipe
    from loongforge.runtime import Runtime


class Job(ABC):
    """A built training job. ``run`` trains to ``train.steps``; ``step`` runs one optimizer step."""

    @abstractmethod
    def step(self) -> dict[str, float]:
        """Run one optimizer step and return its metrics (at least ``loss``)."""

    @abstractmethod
    def run(self) -> dict[str, Any]:
        """Train until ``train.steps`` (resuming if a checkpoint exists) and return final metrics."""

    def close(self) -> None:  # noqa: B027 - optional override
        """Release process groups and other resources."""


class Backend(ABC):
    """Base of every backend. ``model_schema``/``data_schema`` validate the recipe's backend-owned sections."""

    name: ClassVar[str] = "base"
    model_schema: ClassVar[type[BaseModel] | None] = None
    data_schema: ClassVar[type[BaseModel] | None] = None
    # subclasses of core's ParallelConfig / KernelsConfig with this backend's own keys (None: core's as is)
    parallel_schema: ClassVar[type[BaseModel] | None] = None
    kernels_schema: ClassVar[type[BaseModel] | None] = None
    #: keys of the shared sections this backend does not use (dotted key -> why, or what to use instead): a recipe
    #: that sets one to anything but its default is refused rather than silently ignored.
    unused_keys: ClassVar[dict[str, str]] = {}

    @classmethod
    def section_schema(cls, section: str, *, raw: dict[str, Any], recipe: Recipe) -> type[BaseModel] | None:
        """The schema that validates ``section`` of ``recipe`` (default: ``<section>_schema``). A backend whose
        model kinds declare their own keys picks it from ``raw`` or from the sections validated before (``model``
        before ``data``); it may raise ``RecipeError`` naming a key that belongs to another kind."""
        return getattr(cls, f"{section}_schema", None)

    @classmethod
    def recipe_schemas(cls) -> dict[str, type[BaseModel]]:
        """The schema classes of this backend's recipe keys, by title (its first word is the recipe section), for
        ``docs/recipes.md``. Default: the four class attributes above; a backend whose sections depend on the model
        kind adds one entry per kind (e.g. ``"model (dit)"``)."""
        out = {"model": cls.model_schema, "data": cls.data_schema, "parallel": cls.parallel_schema,
               "kernels": cls.kernels_schema}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod  # noqa: B027 - optional override
    def check_recipe(cls, recipe: Recipe) -> None:
        """Cross-section checks that need no process group (raise ``RecipeError``)."""

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        """Validate the recipe for ``world_size`` processes (parallel plan vs model shape)."""
        recipe.parallel.plan(world_size)

    def resolved(self, recipe: Recipe) -> dict[str, Any]:
        """The recipe as plain data with what this backend derives from it filled in (``validate --show``: e.g. a
        preset's sizes, not the nulls of keys the recipe left to it). Default: :meth:`Recipe.to_dict`."""
        return recipe.to_dict()

    @abstractmethod
    def build(self, recipe: Recipe, runtime: Runtime) -> Job:
        """Build the model, data and optimizer for this process."""

    def prepare_data(self, recipe: Recipe, *, force: bool = False) -> Path:
        """``loongforge data prepare RECIPE``: build the data the recipe's ``data`` section describes."""
        raise PluginError(f"backend '{self.name}' has no data preparation step")


def get_backend_class(name: str) -> type[Backend]:
    """The Backend class registered as ``name`` (``PluginError`` naming the package to install if absent)."""
    from loongforge import registry

    cls = registry.backends.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise PluginError(f"loongforge.backends '{name}' does not point to a loongforge.backend.Backend subclass")
    return cls


def get_backend(name: str) -> Backend:
    return get_backend_class(name)()
