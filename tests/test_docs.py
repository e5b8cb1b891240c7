"""The documents point only at files the repository has, and the README's generated parts are current."""

import re
import subprocess
from pathlib import Path

from opdkit import docs_tables, loss_table

ROOT = Path(__file__).resolve().parents[1]
MD_REF = re.compile(r"\b[\w/.-]+\.md\b")
BINARY = (".png", ".parquet", ".safetensors", ".whl")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, text=True,
                         capture_output=True, check=True).stdout
    return [f for f in out.splitlines() if (ROOT / f).is_file()]


def _resolves(ref: str, where: Path, names: set[str]) -> bool:
    """A reference names a file at the root or beside the file that makes it; a bare name or a placeholder
    folder (``OUT/lane.md``: what a script writes) names a file of that name somewhere in the repository."""
    if (ROOT / ref).is_file() or (where.parent / ref).is_file():
        return True
    folder, _, name = ref.rpartition("/")
    return (not folder or folder.isupper()) and name in names


def test_no_file_refers_to_a_markdown_file_the_repository_does_not_have():
    files = _tracked()
    assert "README.md" in files and "docs/design.md" in files  # the scan sees the repository
    names = {Path(f).name for f in files}
    missing = []
    for f in files:
        if f.endswith(BINARY) or f.startswith("opdkit/embedded/assets/") or f == "tests/test_docs.py":  # (its examples)
            continue
        text = (ROOT / f).read_text(errors="replace")
        missing += [f"{f}: {ref}" for ref in MD_REF.findall(text) if not _resolves(ref, ROOT / f, names)]
        missing += [f"{f}: ../shared" for _ in re.findall(r"\.\./shared\b", text)]
    assert not missing, missing


def test_every_cited_section_is_a_heading_of_its_page():
    """``docs/design.md, "run.sh"`` (the code's way of citing a section) names a heading that page has."""
    cite = re.compile(r'\b((?:docs/)?[\w.-]+\.md),? "([^"]+)"')
    bad, n = [], 0
    for f in _tracked():
        if f.endswith(BINARY) or f.startswith("opdkit/embedded/assets/"):
            continue
        for page, section in cite.findall((ROOT / f).read_text(errors="replace")):
            section = " ".join(section.split())  # a citation wrapped over two lines
            target = ROOT / page if (ROOT / page).is_file() else ROOT / "docs" / page
            if not target.is_file():
                continue  # the reference test names it
            n += 1
            headings = [h.lstrip("#").strip() for h in target.read_text().splitlines() if h.startswith("#")]
            if not any(h.startswith(section) for h in headings):
                bad.append(f"{f}: {page}, {section!r}")
    assert n >= 10 and not bad, bad


def test_the_reference_check_finds_a_missing_file():
    names = {"lane.md", "README.md"}
    assert not _resolves("DESIGN.md", ROOT / "run.sh", names)
    assert not _resolves("shared/gpu/VLLM.md", ROOT / "BENCHMARKS.md", names)
    assert _resolves("docs/design.md", ROOT / "opdkit" / "fsutil.py", names)
    assert _resolves("README.md", ROOT / "docs" / "replays.md", names)  # from the root
    assert _resolves("OUT/lane.md", ROOT / "bench" / "real_lane.py", names)  # what a script writes


def test_the_readme_loss_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    a, b = docs_tables.between_markers(readme, "README.md")
    assert readme[a:b] == docs_tables.loss_table_markdown(), "run: python -m opdkit.docs_tables --update README.md"
    rows = readme[a:b].splitlines()[2:]  # under the header and its rule
    assert [re.match(r"\| `(\w+)` \|", r)[1] for r in rows] == list(loss_table.LOSS_NAMES)


def test_docs_tables_update_rewrites_only_the_table(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"before\n{docs_tables.BEGIN}\n| stale |\n{docs_tables.END}\nafter\n")
    assert docs_tables.main(["--update", str(page)]) == 0
    table = docs_tables.loss_table_markdown()
    assert page.read_text() == f"before\n{docs_tables.BEGIN}\n{table}{docs_tables.END}\nafter\n"
    assert docs_tables.main(["--update", str(tmp_path / "none.md")]) == 2
    (tmp_path / "bare.md").write_text("no markers\n")
    assert docs_tables.main(["--update", str(tmp_path / "bare.md")]) == 2


def test_the_readme_is_a_map():
    """At most 250 lines, with the two commands first (CI runs the second)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    head = "\n".join(lines[:15])
    assert 'pip install -e ".[dev]" && dvc repro' in head and 'pip install -e ".[dev]" && pytest' in head
    assert re.search(r"-m pytest", (ROOT / ".ci" / "run").read_text())


# seed 002, "Formal replay": the orchestrator supplies these five variables and invokes exactly `bash run.sh`;
# checkpoints go to /out/checkpoints/checkpoint-<progress>/ (OUTPUT_DIR, CKPT_DIR, EXPERIMENT_NAME are the probes')
ORCHESTRATOR = ("STUDENT_MODEL", "TEACHER_MODEL", "TRAIN_DATA", "MAX_WALL_TIME_SECONDS", "DEADLINE_RESERVE_SECONDS")


def test_the_docs_give_s1s_formal_replay_only_the_orchestrators_variables_and_the_contracts_out():
    """docs/replays.md listed OUTPUT_DIR, EXPERIMENT_NAME and CKPT_DIR among the orchestrator's variables and its
    formal replay command set OUTPUT_DIR=out (checkpoints outside /out/checkpoints); docs/design.md gave OUTPUT_DIR's
    default as out, where run.sh writes to /out when it is there."""
    replays = (ROOT / "docs" / "replays.md").read_text()
    listed = re.search(r"with only the orchestrator's variables \(([^)]*)\)", replays)[1]
    assert tuple(re.findall(r"`([A-Z_]+)`", listed)) == ORCHESTRATOR
    row = next(line for line in replays.splitlines() if line.startswith("| S1's formal replay"))
    command = re.search(r"`([^`]*bash run\.sh)`", row)[1]
    assert tuple(re.findall(r"\b([A-Z_]+)=", command)) == ORCHESTRATOR
    evals = next(line for line in replays.splitlines() if line.startswith("| S1's evaluations"))
    assert "--model /out/checkpoints/checkpoint-" in evals
    design = (ROOT / "docs" / "design.md").read_text()
    default = re.search(r"`OUTPUT_DIR` \(default ([^)]*)\)", design)[1]
    assert default.startswith("`/out`") and "`./out`" in default
    assert 'contract_out="${OPDKIT_CONTRACT_OUT:-/out}"' in (ROOT / "run.sh").read_text()  # what run.sh does


def test_fidelity_says_where_each_replay_differs_from_its_seeded_run():
    """The seeded runs' own behaviours the replays do not copy, each with its reason (docs/fidelity.md): S1's
    baseline published only after a clean trainer return, its formal run saved HF weights only, CompassVerifier; the
    OPSD scripts' top-k 20 sampling and a per-device batch the seeds do not give, against their measured pad offsets;
    and replays.md's account of the alignment check and the OPSD order is the code's."""
    text = (ROOT / "docs" / "fidelity.md").read_text()
    section = text.split("## Where the replays differ from the seeded runs", 1)[1].split("\n## ", 1)[0]
    for needle in ("after a clean trainer return", "HF-only saves", "CompassVerifier", "top-k 20", "device_batch: 1",
                   "292", "weight decay", "embedded default", "Errno-70"):
        assert needle in section, needle
    replays = (ROOT / "docs" / "replays.md").read_text()
    from opdkit.config import RuntimeConfig
    from opdkit.recipes import load_config

    share = RuntimeConfig().alignment_max_weight0_share
    assert f"`runtime.alignment_max_weight0_share` ({share:g})" in " ".join(replays.split())
    assert load_config(None, ROOT / "recipes" / "opsd_released.yaml").data.order == "hf_trainer"
    assert "shuffles with its own seed" not in replays
