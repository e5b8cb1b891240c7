"""The embedded default: the shipped synthetic task and tiny teacher/student HF directories.

``ASSETS`` holds what ``opdkit embedded --rebuild`` produced on the reference machine
(``manifest.json`` records every file's sha256 and how the models were made; manifests written since
issue 17 also record the torch build and CPU capability, which a rebuild's weights depend on).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
PARTS = {"train": "data/train.parquet", "eval": "data/eval.parquet", "teacher": "teacher", "student": "student"}


class MissingAsset(FileNotFoundError):
    """A shipped embedded file is missing (the package data was not installed or was removed)."""


def asset(name: str) -> Path:
    """Path of a shipped part: ``train``, ``eval``, ``teacher`` or ``student``."""
    p = ASSETS / PARTS[name]
    if not p.exists():
        raise MissingAsset(f"the embedded {name} is missing at {p}; rebuild it with "
                           "`opdkit embedded --out DIR --rebuild`")
    return p


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative posix paths), manifest excluded."""
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.name != "manifest.json":
            out[f.relative_to(root).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def copy_shipped(out: Path) -> None:
    """Copy the shipped task and models to ``out`` (data/, teacher/, student/, manifest.json)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("data", "teacher", "student"):
        shutil.copytree(ASSETS / name, out / name, dirs_exist_ok=True)
    shutil.copy2(ASSETS / "manifest.json", out / "manifest.json")


def write_manifest(root: Path, config: dict, made: dict) -> dict:
    """``root/manifest.json``: the build config, how the parts were made (``build.build``'s description,
    whose ``environment`` names the torch build and CPU capability the weights' bits depend on) and the
    sha256 of every file."""
    manifest = {"config": config, "made": made, "files": file_hashes(root)}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
