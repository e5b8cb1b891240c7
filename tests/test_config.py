import dataclasses
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


def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("loss:\n  name: k1\n  bogus: 2\n")
    with pytest.raises(ConfigError, match=r"loss\.bogus.*params\.yaml"):
        load_config(p)


def test_replace_does_not_mutate():
    a = Config()
    b = replace(a, "seed=5")
    assert a.seed == 0 and b.seed == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.seed = 3  # type: ignore[misc]


def test_params_yaml_mirrors_every_key():
    """params.yaml lists every knob (and nothing unknown): it loads, and has each dataclass key."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    load_config(ROOT / "params.yaml")

    def keys(d, prefix=""):
        out = set()
        for k, v in d.items():
            out |= keys(v, prefix + k + ".") if isinstance(v, dict) else {prefix + k}
        return out

    assert keys(raw) == keys(to_dict(Config()))
