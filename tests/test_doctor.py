"""``opdkit doctor`` on the embedded pair (every line OK), the real-scale fixture pair (padding rows
reported, no FAIL) and planted faults (each the FAIL line it should give, exit 1): run through the
CLI's entry point, in a directory that stays empty, with the pair's files unchanged. The planted
faults are the ones ``opdkit train`` refuses (test_fixture.py): the doctor's FAIL line carries the
same problem and fix as train's error, one check serving both."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from opdkit.cli import main as opdkit_main
from opdkit.embedded import asset
from opdkit.models import load_tokenizer
from qwen2_fixture import (
    copy_model,
    fixture_dir,
    read_json,
    student_without_chat_template,
    teacher_with_another_vocabulary,
    teacher_with_fewer_rows,
)

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^(OK|WARN|FAIL|SKIP) +(\S.*?)  +(.*)$")
LIVE = ("memory", "alignment (hf)", "self KL", "teacher repeat", "alignment (vllm)")


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    return fixture_dir(tmp_path_factory)


def snapshot(*dirs: Path) -> dict:
    """Every file under ``dirs`` (links followed) with its size and modification time."""
    return {str(f): (f.stat().st_size, f.stat().st_mtime_ns) for d in dirs for f in sorted(Path(d).rglob("*"))}


def doctor(tmp_path: Path, monkeypatch, capsys, *args: str) -> tuple[int, dict[str, tuple[str, str, str]]]:
    """``opdkit doctor ARGS`` run from an empty directory that must stay empty: (exit status,
    check -> (status, detail, fix)), the wrapped lines of the table joined again."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    rc = opdkit_main(["doctor", "--quiet", *args])
    out = capsys.readouterr().out
    assert not any(cwd.iterdir()), "the doctor wrote into its working directory"
    rows: dict[str, list[str]] = {}
    last = None
    for line in out.splitlines()[:-1]:
        m = LINE.match(line)
        if m:
            last = m.group(2).strip()
            assert last not in rows, f"two lines for {last}"
            rows[last] = [m.group(1), m.group(3), ""]
        elif line.lstrip().startswith("> fix: "):
            rows[last][2] = line.lstrip()[len("> fix: "):]
        else:
            rows[last][1 if not rows[last][2] else 2] += " " + line.strip()
    assert out.splitlines()[-1].endswith("the pair is ready" if rc == 0 else "fix each FAIL before training"), out
    return rc, {k: tuple(v) for k, v in rows.items()}


def test_doctor_on_the_embedded_pair_is_all_ok(tmp_path, monkeypatch, capsys):
    pair = [asset("student"), asset("teacher"), asset("train")]
    before = snapshot(*pair[:2])
    rc, rows = doctor(tmp_path, monkeypatch, capsys, "-p", "none", "--student", str(pair[0]), "--teacher", str(pair[1]),
                      "--data", str(pair[2]))
    assert rc == 0
    assert {k: s for k, (s, _, _) in rows.items() if s != "OK"} == {"alignment (vllm)": "SKIP"}, rows
    n = len(load_tokenizer(asset("student")))
    assert n == read_json(asset("student"), "config.json")["vocab_size"] == 33
    assert rows["embedding rows"][1] == "student 33, teacher 33 rows = the tokenizer's 33 ids (no padding rows)"
    assert "KL 0 " in rows["self KL"][1] and "identically" in rows["teacher repeat"][1]
    assert "the student stops at 2 '<eos>'" in rows["special tokens"][1]
    assert "temperature 0.7, top_p 0.9 are replaced" in rows["generation config (student)"][1]
    assert "not installed" in rows["alignment (vllm)"][1]
    assert snapshot(*pair[:2]) == before


def test_doctor_on_the_fixture_pair_reports_its_padding_rows(fx, tmp_path, monkeypatch, capsys):
    """The real Qwen2.5 vocabulary: 151,665 ids, 151,936 / 152,064 embedding rows (the published sizes
    of Qwen2.5-1.5B and -7B); the student's generation_config.json asks for repetition_penalty 1.05."""
    before = snapshot(fx)
    rc, rows = doctor(tmp_path, monkeypatch, capsys, "-p", "none", "-r", str(ROOT / "recipes" / "s1.yaml"),
                      "--student", str(fx / "student"), "--teacher", str(fx / "teacher"),
                      "--data", str(fx / "data" / "train.parquet"))
    assert rc == 0 and not [k for k, (s, _, _) in rows.items() if s == "FAIL"], rows
    assert rows["embedding rows"] == ("OK", "student 151,936, teacher 152,064 rows for the tokenizer's 151,665 ids: "
                                      "padding rows student 271, teacher 399, never sampled, excluded from scoring "
                                      "(log-probs renormalised over the shared ids)", "")
    status, detail, fix = rows["generation config (student)"]
    assert status == "WARN" and "repetition_penalty=1.05" in detail and fix
    assert rows["generation config (teacher)"][0] == "OK"
    assert rows["special tokens"][0] == "OK"
    assert "ends a turn with 151645 '<|im_end|>' (a stop id)" in rows["special tokens"][1]
    assert rows["chat template"][0] == "OK" and rows["data"][1].endswith("32 rows selected (chat messages)")
    assert all(rows[c][0] == "OK" for c in LIVE[:4]), rows
    assert "gradient checkpointing" in rows["memory"][1] and "151,936" in rows["memory"][1]
    assert snapshot(fx) == before


FAULTS = {  # fault -> (which model it replaces, params, the check that fails, what its line says)
    "another vocabulary": (teacher_with_another_vocabulary, "teacher", [], "vocabulary",
                           ("teacher and student tokenizers disagree", "token id")),
    "no chat template": (student_without_chat_template, "student", ["data.chat_template=true"], "chat template",
                         ("data.chat_template=true but its tokenizer has no chat template",)),
    "fewer rows": (teacher_with_fewer_rows, "teacher", [], "embedding rows",
                   ("its input embedding has 151,643 rows but the tokenizer can emit ids 0..151,664",)),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_doctor_gives_the_fail_line_of_a_planted_fault(fault, fx, tmp_path, monkeypatch, capsys):
    make, role, params, check, says = FAULTS[fault]
    bad = make(fx, tmp_path / "bad" / role)
    pair = {"student": fx / "student", "teacher": fx / "teacher", role: bad}
    before = snapshot(fx, bad)
    sets = [x for p in params for x in ("-S", p)]
    rc, rows = doctor(tmp_path, monkeypatch, capsys, "-p", "none", *sets, "--student", str(pair["student"]),
                      "--teacher", str(pair["teacher"]), "--data", str(fx / "data" / "train.parquet"))
    assert rc == 1
    assert [k for k, (s, _, _) in rows.items() if s == "FAIL"] == [check], rows
    status, detail, fix = rows[check]
    assert str(bad) in detail and all(s in detail for s in says) and fix, rows[check]
    assert all(rows[c][0] == "SKIP" for c in LIVE)
    assert snapshot(fx, bad) == before
    # train's preflight refuses the same pair with the same check's message (exit 2, nothing written)
    out = tmp_path / "out"
    code = opdkit_main(["train", "--check", "--out", str(out), "-p", "none", *sets, "-S",
                        f"student.path={pair['student']}",
                        "-S", f"teacher.path={pair['teacher']}", "-S", f"data.train={fx / 'data' / 'train.parquet'}"])
    assert code == 2 and capsys.readouterr().err.strip() == f"opdkit: error: {detail}; {fix}"
    assert not out.exists()


def test_doctor_names_dropout_that_makes_the_student_differ_from_itself(tmp_path, monkeypatch, capsys):
    student = copy_model(asset("student"), tmp_path / "student", skip=("config.json",))
    (student / "config.json").write_text(json.dumps(read_json(asset("student"),
                                                              "config.json") | {"attention_dropout": 0.5}))
    rc, rows = doctor(tmp_path, monkeypatch, capsys, "-p", "none", "--student", str(student))
    assert rc == 1
    status, detail, fix = rows["self KL"]
    assert status == "FAIL" and "attention_dropout=0.5" in detail and "to 0" in fix, rows["self KL"]
    assert rows["embedding rows"][0] == rows["vocabulary"][0] == "OK"


def test_doctor_bad_arguments_exit_2_and_missing_directories_fail(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert opdkit_main(["doctor", "-p", "none", "-S", "rollout.temprature=0.6"]) == 2
    assert "unknown params key 'rollout.temprature'" in capsys.readouterr().err
    rc, rows = doctor(tmp_path, monkeypatch, capsys, "-p", "none", "--teacher", str(tmp_path / "nowhere"))
    assert rc == 1 and rows["teacher model"][0] == "FAIL" and "does not exist" in rows["teacher model"][1]
    assert rows["student model"][0] == "OK" and rows["teacher tokenizer"][0] == "SKIP"
