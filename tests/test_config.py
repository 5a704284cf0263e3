from dataclasses import dataclass, field

import pytest

from cookbook.config import ConfigError, load_config, resolve_path


@dataclass
class Optim:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class Schema:
    steps: int = 10
    name: str | None = None
    optim: Optim = field(default_factory=Optim)


def test_yaml_and_overrides_merge_in_order(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("steps: 5\noptim:\n  lr: 0.1\n")
    cfg = load_config(Schema, f, ["optim.lr=3e-5", "name=run1", "optim.betas=[0.8,0.9]"])
    assert isinstance(cfg, Schema) and isinstance(cfg.optim, Optim)
    assert (cfg.steps, cfg.name, cfg.optim.lr, cfg.optim.betas) == (5, "run1", 3e-5, [0.8, 0.9])


@pytest.mark.parametrize("yaml_text, overrides, expected", [
    ("optim:\n  beta: 3\n", [], "key 'optim.beta'"),          # unknown key in the file
    ("", ["optim.lrr=1"], "key 'optim.lrr'"),                   # unknown key on the command line
    ("steps: many\n", [], "key 'steps'"),                       # wrong type in the file
    ("", ["steps=1.5"], "key 'steps'"),                         # wrong type on the command line
    ("", ["steps"], "not of the form section.key=value"),      # malformed override
    ("- a\n- b\n", [], "top level must be a mapping"),
])
def test_bad_config_names_the_key_and_source(tmp_path, yaml_text, overrides, expected):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(Schema, f, overrides)
    assert expected in str(err.value)
    where = f"override {overrides[0]!r}" if overrides else str(f)
    assert where in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Schema, tmp_path / "nope.yaml")


def test_resolve_path_prefers_the_config_folder(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.csv").write_text("1")
    monkeypatch.chdir("/")
    assert resolve_path("data/x.csv", tmp_path) == str(tmp_path / "data" / "x.csv")
    assert resolve_path("org/model-id", tmp_path) == "org/model-id"  # hub ids pass through
