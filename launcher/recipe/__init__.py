"""The recipe: a typed schema, loaded from YAML plus key=value overrides, and `_target_` instantiation."""

from launcher.recipe.instantiate import instantiate, locate
from launcher.recipe.load import Loaded, load
from launcher.recipe.schema import Recipe

__all__ = ["Loaded", "Recipe", "instantiate", "load", "locate"]
