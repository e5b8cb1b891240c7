"""Recipes: params overlays for reference configurations (the YAML files under ``recipes/``).

A recipe is a partial params tree, merged over the params file (sections merge key by key; a
value, list included, replaces the params value), then ``key=value`` overrides apply on top:
``params.yaml < recipe < -S``. A recipe may start from another with ``extends: other.yaml``
(a path relative to the recipe's own file). Keys are checked by ``opdkit.config``: a typo in a
recipe is an error that names the key.

Which recipe: the one given explicitly (``opdkit -r FILE``), else the one the params name in
their ``recipe`` key (after any ``-S recipe=...``), a path relative to the params file's folder,
as DVC resolves the ``${recipe}`` dependency beside ``params.yaml``; ``""`` means none. The
resolved config's ``recipe`` says which file was applied. A recipe sets run params only: it may not
name a recipe itself (use ``extends``) nor set the ``pipeline`` section (dvc.yaml reads the seeds
and arms from params.yaml, so a recipe's would be ignored there).

``opdkit.config.load_config`` reads a params file as it is, without its recipe: for a resolved
config (a run's ``config.yaml``), whose ``recipe`` key only records what was applied.

``OPSD_SWITCHES``: the OPSD log's environment switches (seed 004, "Code switches") as params
overrides; run.sh applies the ones set in its environment (``python -m opdkit.recipes opsd-env``
prints them) after the recipe, and refuses a value or an ``OPSD_*`` variable it does not know.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from opdkit.config import Config, ConfigError, config_from_dict, parse_override, read_yaml_mapping as _read_yaml

NOT_IN_RECIPES = ("recipe", "pipeline")


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
    for key in NOT_IN_RECIPES:
        if key in raw:
            why = ("build on another recipe with 'extends: other.yaml'" if key == "recipe" else
                   "the pipeline's seeds and arms stay in params.yaml, where dvc.yaml reads them")
            raise ConfigError(f"recipe {path} sets '{key}', which a recipe may not: {why}")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"recipe {path}: 'extends' expected a recipe file (relative to {p.parent}), got {parent!r}")
    base = p.parent / parent
    if not base.is_file():  # else the error named only the missing file, not the recipe that extends it
        what = "is a directory, not a YAML file" if base.is_dir() else "does not exist"
        raise ConfigError(f"recipe {path}: 'extends: {parent}' names {base}, which {what} (a path relative to the "
                          "recipe's folder)")
    return overlay(recipe_tree(base, _seen + (p,)), raw)


def _named_recipe(raw: dict, params: str | Path | None,
                  parsed: list[tuple[str, object]]) -> tuple[str, Path | None, str]:
    """The recipe the params name: (as written, the file, where it was named)."""
    name, where = raw.get("recipe", ""), f"params key 'recipe' in {params}"
    for key, value in parsed:
        if key == "recipe":
            name, where = value, f"params key 'recipe' (-S recipe={value})"
    if name is None:
        name = ""
    if not isinstance(name, str):
        raise ConfigError(f"{where}: expected str (a recipe file, or '' for none), got {name!r}")
    if not name:
        return "", None, where
    base = Path(params).parent if params is not None else Path()
    return name, base / name, where


def load_config(params: str | Path | None, recipe: str | Path | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """``params`` (None = defaults only) < a recipe < ``overrides``, validated.

    ``recipe``: a file (as given on the command line; it wins over the params' own), ``""`` for
    none, or None for the one the params' ``recipe`` key names (relative to the params file).
    """
    raw = _read_yaml(Path(params), "params file") if params is not None else {}
    parsed = [parse_override(o) for o in overrides]  # checks every key before any file is read
    if recipe is None:
        name, path, where = _named_recipe(raw, params, parsed)
    else:
        name, path, where = str(recipe), (Path(recipe) if str(recipe) else None), "-r/--recipe"
    if path is not None:
        if not path.is_file():
            if where == "-r/--recipe":
                what = "is a directory, not a YAML file" if path.is_dir() else "does not exist"
                raise ConfigError(f"recipe {name} {what} (-r/--recipe)")
            raise ConfigError(f"{where} names recipe {name}, which does not exist (looked for {path.absolute()}); "
                              "name a file under recipes/, or '' for none")
        raw = overlay(raw, recipe_tree(path))
    raw = {**raw, "recipe": name}  # the record of what was applied
    rest = [o for o, (key, _) in zip(overrides, parsed) if key != "recipe"]
    try:
        return config_from_dict(raw, rest)
    except ConfigError as e:  # where the value came from: the files applied (none: built-in defaults and -S)
        files = ", ".join(f"{what} {f}" for what, f in (("params", params), ("recipe", path)) if f is not None)
        raise ConfigError(f"{e} ({files})" if files else str(e)) from None


# --- the OPSD log's environment switches ---------------------------------------------------------------

def _selection(**keys: str) -> tuple[str, ...]:
    """``data.filters`` overrides: ``keys`` (as YAML text), every other filter at "no selection"."""
    none = {"answer_regex": "", "exclude_sources": "[]", "reference": "solution", "min_reference_tokens": "0",
            "top_reference_fraction": "1.0"}
    return tuple(f"data.filters.{k}={v}" for k, v in {**none, **keys}.items())


# variable -> {value: the params overrides it means}; the first value is the released behaviour (what
# recipes/opsd_released.yaml holds, so an unset variable changes nothing there)
OPSD_SWITCHES: dict[str, dict[str, tuple[str, ...]]] = {
    # right: the released collator's [prompt][pads][completion] (the alignment check keeps its span part there)
    "OPSD_PAD_SIDE": {"right": ("data.pad_side=right",), "left": ("data.pad_side=left",)},
    # paper: the released collator's student message, without thinking (its student_thinking defaults to false);
    # eval: byte-identical to the benchmark's prompt, as the benchmark renders it (the evaluator's message with
    # thinking on: the OPSD recipes' eval.enable_thinking), so the student then samples in thinking mode
    "OPSD_STUDENT_PROMPT": {"paper": ("data.prompt_format=opsd_student", "data.enable_thinking=false"),
                            "eval": ("data.prompt_format=opsd_eval", "data.enable_thinking=true")},
    "OPSD_TEACHER_CONTEXT": {v: (f"data.teacher_context={v}",) for v in ("solution", "cot", "both")},
    # entry: min(p_T log(p_T/p_S), tau) per vocabulary entry; token: a direction-preserving cap per token
    "OPSD_CLIP_MODE": {v: (f"loss.clip={v}",) for v in ("entry", "token")},
    # hard: answers fully matching -?\d{1,6} with a COT_Reason trace of >= 2,000 tokens (29,434 -> 9,775 rows);
    # nomath: source=math dropped, the upper half by trace length kept (29,434 -> 12,048 rows)
    "OPSD_DATA_SELECT": {"none": _selection(),
                         "hard": _selection(answer_regex="'-?\\d{1,6}'", reference="cot", min_reference_tokens="2000"),
                         "nomath": _selection(exclude_sources="[math]", reference="cot", top_reference_fraction="0.5")},
    # tail weight averaging: the seed shipped it off and never ran it; opdkit does not implement it
    "OPSD_WAVG_LAST": {"0": ()},
}


def opsd_overrides(environ: Mapping[str, str]) -> list[str]:
    """The params overrides of the ``OPSD_*`` variables set (non-empty) in ``environ``, in table order.
    ``ConfigError`` (one line) for an unknown variable or value, and for ``OPSD_WAVG_LAST`` other than 0."""
    unknown = sorted(k for k in environ if k.startswith("OPSD_") and k not in OPSD_SWITCHES)
    if unknown:
        raise ConfigError(f"unknown OPSD switch {unknown[0]}; the known ones: {', '.join(OPSD_SWITCHES)}")
    out: list[str] = []
    for name, values in OPSD_SWITCHES.items():
        value = environ.get(name, "").strip()
        if not value:
            continue
        if name == "OPSD_WAVG_LAST" and value.isdigit() and int(value) == 0:
            continue
        if name == "OPSD_WAVG_LAST":
            raise ConfigError(f"OPSD_WAVG_LAST={value}: tail weight averaging is not implemented in opdkit (the seed "
                              "shipped it off, default 0, and never ran it); unset it or set 0")
        if value not in values:
            raise ConfigError(f"{name}={value}: expected one of {', '.join(values)} "
                              "(the first is the released behaviour)")
        out += values[value]
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m opdkit.recipes opsd-env``: print the overrides of this environment's OPSD_* switches,
    one per line (exit 2 and one line on stderr for a bad one)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["opsd-env"]:
        print("usage: python -m opdkit.recipes opsd-env", file=sys.stderr)
        return 2
    try:
        overrides = opsd_overrides(os.environ)
    except ConfigError as e:
        print(f"run.sh: error: {e}", file=sys.stderr)
        return 2
    for o in overrides:
        print(o)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
