import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from opdkit.config import Config, ConfigError, config_from_dict, dump_yaml, load_config, replace, to_dict

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_roundtrip():
    cfg = Config()
    assert config_from_dict(to_dict(cfg)) == cfg
    assert config_from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg


def test_overrides_are_typed():
    cfg = config_from_dict({}, ["loss.name=jsd", "optim.lr=3e-4", "budget.max_steps=7", "lora.enabled=true",
                                "optim.betas=[0.8, 0.9]", "studies.padding_k=[0, 3]"])
    assert cfg.loss.name == "jsd" and cfg.optim.lr == 3e-4 and cfg.budget.max_steps == 7
    assert cfg.lora.enabled is True and cfg.optim.betas == (0.8, 0.9) and cfg.studies.padding_k == (0, 3)
    assert isinstance(cfg.optim.lr, float)
    assert config_from_dict({}, ["optim.lr=1"]).optim.lr == 1.0  # int -> float is fine


@pytest.mark.parametrize("override, needle", [
    ("loss.nme=jsd", "loss.nme"),
    ("nope=1", "nope"),
    ("budget.max_steps=abc", "budget.max_steps"),
    ("budget.max_steps=1.5", "expected int"),
    ("lora.enabled=3", "expected bool"),
    ("loss.name=kl2", "expected one of"),
    ("loss=3", "loss"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        config_from_dict({}, [override])


@pytest.mark.parametrize("override, needle, edge", [
    ("rollout.temperature=-1", r"'rollout\.temperature': expected >= 0 \(0 = greedy\), got -1\.0",
     "rollout.temperature=0"),
    ("eval.temperature=-0.5", r"'eval\.temperature': expected >= 0", "eval.temperature=0"),
    ("rollout.max_new_tokens=0", r"'rollout\.max_new_tokens': expected >= 1", "rollout.max_new_tokens=1"),
    ("eval.n_samples=0", r"'eval\.n_samples': expected >= 1", "eval.n_samples=1"),
    ("optim.lr=-1e-4", r"'optim\.lr': expected a finite learning rate >= 0", "optim.lr=0"),
    ("optim.lr=nan", r"'optim\.lr': expected a finite", "optim.lr=0"),
    ("optim.lr=.inf", r"'optim\.lr': expected a finite", "optim.lr=0"),
    ("budget.max_steps=-3", r"'budget\.max_steps': expected >= 0 \(0 = no step horizon\)", "budget.max_steps=0"),
    ("budget.max_wall_time_s=-1", r"'budget\.max_wall_time_s': expected >= 0", "budget.max_wall_time_s=0"),
    ("optim.micro_batch=-1", r"'optim\.micro_batch': expected >= 0 \(0 = the whole step at once\)",
     "optim.micro_batch=0"),
    ("optim.weight_decay=-0.1", r"'optim\.weight_decay': expected >= 0", "optim.weight_decay=0"),
    ("data.max_rows=-5", r"'data\.max_rows': expected >= 0 \(0 = all rows\)", "data.max_rows=0"),
    ("eval.max_questions=-1", r"'eval\.max_questions': expected >= 0", "eval.max_questions=0"),
    ("rollout.batch_size=-1", r"'rollout\.batch_size': expected >= 0", "rollout.batch_size=0"),
    ("runtime.logprob_chunk=0", r"'runtime\.logprob_chunk': expected >= 1", "runtime.logprob_chunk=1"),
    ("loss.topk=0", r"'loss\.topk': expected >= 1", "loss.topk=1"),
    ("loss.clip_eps=-1", r"'loss\.clip_eps': expected >= 0", "loss.clip_eps=0"),
    ("loss.clip_tau=-1", r"'loss\.clip_tau': expected >= 0", "loss.clip_tau=0"),
    ("loss.jsd_beta=2", r"'loss\.jsd_beta': expected 0 <= beta <= 1", "loss.jsd_beta=1"),
    ("loss.dual_clip=0.5", r"'loss\.dual_clip': expected 0 \(off\) or > 1", "loss.dual_clip=0"),
    ("publish.every_steps=-1", r"'publish\.every_steps': expected >= 0 \(0 = at the end only\)",
     "publish.every_steps=0"),
    ("publish.keep=0", r"'publish\.keep': expected >= 1, got 0", "publish.keep=1"),
    ("publish.keep_states=0", r"'publish\.keep_states': expected >= 1, got 0", "publish.keep_states=1"),
    ("rollout.overlap=2", r"'rollout\.overlap': expected 0 \(on-policy\) or 1", "rollout.overlap=1"),
    ("loss.teacher_temperature=0", r"'loss\.teacher_temperature': expected > 0, got 0\.0",
     "loss.teacher_temperature=0.01"),
])
def test_out_of_range_values_name_the_key_and_the_range(override, needle, edge):
    """A value of the right type but outside its range is refused with the params, not run: a negative
    temperature sampled greedily without a word, a NaN or negative learning rate trained to non-finite
    weights or away from the teacher, a negative step budget meant "no horizon", optim.micro_batch=-1 trained
    on no micro-batch at all, data.max_rows=-5 sliced rows off the end, and loss.topk=0, loss.jsd_beta=2 or
    runtime.logprob_chunk=0 failed inside the first step (a traceback, exit 1) after the run directory was
    written."""
    with pytest.raises(ConfigError, match=needle):
        config_from_dict({}, [override])
    config_from_dict({}, [edge])  # the edge of the range is fine


@pytest.mark.parametrize("override, hint", [
    ("rollout.temprature=1", "; did you mean 'rollout.temperature'?"),
    ("optim.lrr=1", "; did you mean 'optim.lr'?"),
    ("rollout.lr=1", "; did you mean 'optim.lr' or 'embedded.lr'?"),  # a key of another section
    ("lr=1", "; did you mean 'optim.lr' or 'embedded.lr'?"),
    ("data.filters.answer_rgx=x", "; did you mean 'data.filters.answer_regex'?"),
    ("nosuch=1", " (no 'nosuch' in top level"),
])
def test_an_unknown_key_says_what_it_may_have_meant(override, hint):
    """A misspelt key, or one put in the wrong section, is named with the key it most likely meant (the error
    listed the section's keys and left the user to find it)."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({}, [override])
    assert str(e.value).startswith(f"unknown params key '{override.split('=')[0]}'{hint}"), str(e.value)
    with pytest.raises(ConfigError, match=r"unknown params key 'optimizer'; did you mean 'optim'\? \(known keys"):
        config_from_dict({"optimizer": {"lr": 1.0}})


def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("loss:\n  name: k1\n  bogus: 2\n")
    with pytest.raises(ConfigError, match=r"loss\.bogus.*params\.yaml"):
        load_config(p)


def test_a_bad_yaml_file_or_value_is_named_in_one_line(tmp_path):
    """PyYAML's message spans several lines (the mark, a caret); the CLI's contract is one line."""
    (tmp_path / "params.yaml").write_text("optim:\n  lr: [1e-4\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "params.yaml")
    assert re.fullmatch(rf"params file {re.escape(str(tmp_path))}/params.yaml is not valid YAML: expected ',' or "
                        r"']', but got '<stream end>' at line 3, column 1", str(e.value)), str(e.value)
    with pytest.raises(ConfigError, match=r"value is not valid YAML \(.* at line 1, column 3\)$") as e:
        config_from_dict({}, ["optim.lr=[1"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"params file .* is a directory, not a YAML file$"):
        load_config(tmp_path)


def test_replace_does_not_mutate():
    a = Config()
    b = replace(a, "seed=5")
    assert a.seed == 0 and b.seed == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.seed = 3  # type: ignore[misc]


def _leaves(tree: dict, prefix: str = "") -> dict:
    """Dotted key -> value of every non-mapping value (a list, of control arms too, is one value)."""
    out = {}
    for k, v in tree.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _tracked() -> set[str]:
    """The params keys dvc.yaml's stages track: their `params:` lists and the ${...} values of their commands and
    paths (the `vars:` entries are dvc.yaml's own, not params)."""
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    own = {k for entry in dvc.get("vars", []) for k in entry}
    keys = set()
    for stage in dvc["stages"].values():
        for p in stage.get("params", []):
            keys |= {p} if isinstance(p, str) else {k for ks in p.values() for k in ks}
        for ref in re.findall(r"\$\{([^}]+)\}", json.dumps(stage)):
            if ref.split(".")[0] not in own:
                keys.add(re.sub(r"\[\d+\]$", "", ref))  # pipeline.seeds[0] -> pipeline.seeds
    return keys


def _study_marked(text: str) -> set[str]:
    """The dotted keys whose line in params.yaml carries a `# study:` reason."""
    stack, marked = [], set()
    for line in text.splitlines():
        m = re.match(r"^( *)([A-Za-z_]\w*):", line)
        if not m:
            continue
        while stack and stack[-1][0] >= len(m[1]):
            stack.pop()
        stack.append((len(m[1]), m[2]))
        if "# study:" in line:
            marked.add(".".join(k for _, k in stack))
    return marked


def _covered(key: str, tracked: set[str]) -> bool:
    return any(key == t or key.startswith(t + ".") for t in tracked)


def test_params_yaml_is_the_built_in_defaults_plus_the_studys_marked_overlay():
    """Every params.yaml key either differs from opdkit/config.py's default, and then carries a `# study:` reason,
    or equals it and is there because a dvc.yaml stage tracks it; nothing unknown."""
    text = (ROOT / "params.yaml").read_text()
    written = _leaves(yaml.safe_load(text))
    resolved, default = _leaves(to_dict(load_config(ROOT / "params.yaml"))), _leaves(to_dict(Config()))
    differs = {k for k in written if resolved[k] != default[k]}
    assert differs == _study_marked(text), "mark each key that differs from its default with '# study: <reason>'"
    pinned_untracked = sorted(k for k in set(written) - differs if not _covered(k, _tracked()))
    assert not pinned_untracked, f"{pinned_untracked}: at their default and tracked by no stage: leave them out"


def test_every_key_the_pipeline_tracks_is_in_params_yaml():
    """DVC reads each tracked key from params.yaml (`dvc repro` stops on a missing one) and `dvc exp run -S` sets
    only keys the file has: a tracked section lists every key of its section."""
    written, default = _leaves(yaml.safe_load((ROOT / "params.yaml").read_text())), _leaves(to_dict(Config()))
    tracked = _tracked()
    assert {"loss", "optim", "runtime", "pipeline", "recipe", "loss.name", "budget.max_steps"} <= tracked
    missing = sorted(k for k in default if _covered(k, tracked) and k not in written)
    assert not missing, f"dvc.yaml tracks {missing} but params.yaml does not have them"


def test_the_studys_overlay_is_what_the_committed_dvc_lock_ran_with():
    """The `# study:` values are those dvc.lock recorded for the stages that track them (the committed results)."""
    text = (ROOT / "params.yaml").read_text()
    written = _leaves(yaml.safe_load(text))
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]
    recorded: dict[str, object] = {}
    for stage in lock.values():
        for key, value in stage.get("params", {}).get("params.yaml", {}).items():
            recorded.update(_leaves(value, key + ".") if isinstance(value, dict) else {key: value})
    marked = _study_marked(text)
    assert marked and marked <= set(recorded), sorted(marked - set(recorded))
    assert {k: recorded[k] for k in marked} == {k: written[k] for k in marked}
