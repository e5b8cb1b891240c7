"""Recipes: params overlays for reference configurations (the YAML files under ``recipes/``).

A recipe is a partial params tree, merged over the params file (sections merge key by key; a
value, list included, replaces the params value), then ``key=value`` overrides apply on top:
``params.yaml < recipe < -S``. A recipe may start from another with ``extends: other.yaml``
(a path relative to the recipe's own file). Keys are checked by ``opdkit.config``: a typo in a
recipe is an error that names the key.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from opdkit.config import Config, ConfigError, config_from_dict, read_yaml_mapping as _read_yaml


def overlay(base: dict, top: dict) -> dict:
    """A new tree: ``top`` merged over ``base`` (dicts recursively, anything else replaced)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = overlay(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def recipe_tree(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """The params overlay of recipe ``path``, with its ``extends`` chain resolved."""
    p = Path(path).resolve()
    if p in _seen:
        raise ConfigError(f"recipe {path}: 'extends' loops back to itself")
    raw = _read_yaml(p, "recipe")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    return overlay(recipe_tree(p.parent / str(parent), _seen + (p,)), raw)


def load_config(params: str | Path | None, recipe: str | Path | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """``params`` (None = defaults only) < ``recipe`` (None = none) < ``overrides``, validated."""
    raw = _read_yaml(Path(params), "params file") if params is not None else {}
    if recipe is not None:
        raw = overlay(raw, recipe_tree(recipe))
    try:
        return config_from_dict(raw, overrides)
    except ConfigError as e:
        raise ConfigError(f"{e} (params {params}, recipe {recipe})") from None
