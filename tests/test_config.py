from dataclasses import dataclass, field

import pytest

from cookbook.config import ConfigError, check_fields, load_config, resolve_path


@dataclass
class Optim:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    names: list[str] = field(default_factory=list)
    fused: bool = False


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


def test_a_whole_float_for_an_integer_key_is_that_integer_and_one_string_for_a_list_a_list_of_one(tmp_path):
    """As the data readers take ``3.0`` for an integer (a config written by a script, a spreadsheet); 1.5 is refused.
    ``optim.names=a`` for a list of strings is ``[a]``; a number there is refused, naming the list syntax."""
    f = tmp_path / "c.yaml"
    f.write_text("steps: 30.0\noptim:\n  lr: 2.0\n")
    cfg = load_config(Schema, f, [])
    assert (cfg.steps, type(cfg.steps), cfg.optim.lr, type(cfg.optim.lr)) == (30, int, 2.0, float)
    assert load_config(Schema, f, ["steps=5.0"]).steps == 5
    with pytest.raises(ConfigError, match=r"override 'steps=1.5': key 'steps': Value '1.5' of type 'float'"):
        load_config(Schema, f, ["steps=1.5"])
    assert load_config(Schema, f, ["optim.names=train.jsonl"]).optim.names == ["train.jsonl"]
    assert load_config(Schema, f, ["optim.names=[a,b]"]).optim.names == ["a", "b"]
    with pytest.raises(ConfigError, match=r"key 'optim.betas': .* \(a list is written \[a,b\]\)"):
        load_config(Schema, f, ["optim.betas=0.9"])


@pytest.mark.parametrize(
    "overrides, hint",
    [
        (["optim.lrr=1"], "(did you mean 'optim.lr'?)"),  # a key of the section
        (["optm.lr=1"], "(did you mean 'optim'?)"),  # a section
        (["optim.zzz=1"], None),  # nothing close: no guess
    ],
)
def test_an_unknown_key_suggests_the_closest_known_one(overrides, hint):
    with pytest.raises(ConfigError) as err:
        load_config(Schema, None, overrides)
    assert (hint in str(err.value)) if hint else "did you mean" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "steps: 5\noptim:\n  betas: [0.9, 0.95]\n  lrr: 0.1\n",
            "line 4: key 'optim.lrr': Key 'lrr' not in 'Optim' (did you mean 'optim.lr'?)",
        ),
        ("optm:\n  lr: 0.1\n", "line 1: key 'optm': Key 'optm' not in 'Schema' (did you mean 'optim'?)"),
        ("steps: 5\noptim:\n  lr: fast\n", "line 3: key 'optim.lr': Value 'fast' of type 'str' could not be converted"),
    ],
)
def test_a_bad_key_in_the_yaml_file_is_named_with_its_line_and_the_closest_known_key(tmp_path, text, message):
    """Before: the file and the key alone (no line)."""
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(Schema, f)
    assert str(err.value).startswith(f"{f} {message}"), str(err.value)


@pytest.mark.parametrize(
    "yaml_text, overrides, expected",
    [
        ("optim:\n  beta: 3\n", [], "key 'optim.beta'"),  # unknown key in the file
        ("", ["optim.lrr=1"], "key 'optim.lrr'"),  # unknown key on the command line
        ("steps: many\n", [], "key 'steps'"),  # wrong type in the file
        ("", ["steps=1.5"], "key 'steps'"),  # wrong type on the command line
        ("", ["optim.fused=maybe"], "key 'optim.fused': Value 'maybe' is not a valid bool (true or false)"),
        ("", ["steps"], "not of the form section.key=value"),  # malformed override
        ("- a\n- b\n", [], "top level must be a mapping"),
    ],
)
def test_bad_config_names_the_key_and_source(tmp_path, yaml_text, overrides, expected):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(Schema, f, overrides)
    assert expected in str(err.value)
    where = f"override {overrides[0]!r}" if overrides else str(f)
    assert where in str(err.value)


def test_missing_file(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Schema, tmp_path / "nope.yaml")
    recipe, elsewhere = tmp_path / "recipe", tmp_path / "elsewhere"
    recipe.mkdir(), elsewhere.mkdir()
    (recipe / "tiny.yaml").write_text("steps: 5\n")
    monkeypatch.setattr("sys.argv", [str(recipe / "train.py")])
    monkeypatch.chdir(elsewhere)  # `python recipe/train.py --config tiny.yaml` from another folder
    with pytest.raises(ConfigError) as err:
        load_config(Schema, "tiny.yaml")
    assert str(err.value) == (
        f"config file not found: tiny.yaml (from {elsewhere}); {recipe / 'tiny.yaml'} exists: give that path"
    )


def test_resolve_path_prefers_the_config_folder(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.csv").write_text("1")
    monkeypatch.chdir("/")
    assert resolve_path("data/x.csv", tmp_path) == str(tmp_path / "data" / "x.csv")
    assert resolve_path("org/model-id", tmp_path) == "org/model-id"  # hub ids pass through


@pytest.mark.parametrize(
    "overrides, rules, expected",
    [
        (["steps=0"], dict(at_least={"steps": 1}), "steps must be >= 1, got 0"),
        (["steps=1"], dict(at_least={"steps": 1}), None),  # the minimum itself passes
        (["name=adam"], dict(one_of={"name": ("sgd", "adamw")}), "name must be one of 'sgd', 'adamw', got 'adam'"),
        (["optim.lr=0"], dict(within={"optim.lr": "[0, 1)"}), None),  # closed end
        (["optim.lr=1"], dict(within={"optim.lr": "[0, 1)"}), "optim.lr must be in [0, 1), got 1.0"),
        (["optim.lr=0"], dict(within={"optim.lr": "(0, 1)"}), "optim.lr must be in (0, 1), got 0.0"),
        (["optim.lr=1"], dict(within={"optim.lr": "(0, 1]"}), None),
        (
            ["steps=-2"],
            dict(at_least={"steps": -1}, notes={"steps": "-1: never"}),
            "steps must be >= -1, got -2 (-1: never)",
        ),
        ([], dict(at_least={"optim.momentum": 0}), "optim.momentum: no such config key"),
    ],
)
def test_check_fields_names_the_key_the_rule_and_the_value(overrides, rules, expected):
    cfg = load_config(Schema, None, overrides)
    if expected is None:
        check_fields(cfg, **rules)
        return
    with pytest.raises(ConfigError) as err:
        check_fields(cfg, **rules)
    assert str(err.value) == expected


def test_values_from_the_environment_are_used_but_never_written_out(tmp_path, monkeypatch):
    from cookbook.config import save_config, to_dict
    from cookbook.ray_train.worker import config_from_dict

    monkeypatch.setenv("COOKBOOK_TEST_SECRET", "hf_s3cret")
    f = tmp_path / "c.yaml"
    f.write_text("name: ${oc.env:COOKBOOK_TEST_SECRET}\n")
    cfg = load_config(Schema, f, ["optim.lr=0.5"])
    assert cfg.name == "hf_s3cret"  # the run uses the value
    written = to_dict(cfg)  # what goes into config.yaml, meta.json, MLflow params
    assert written["name"] == "${oc.env:COOKBOOK_TEST_SECRET}" and written["optim"]["lr"] == 0.5
    save_config(cfg, tmp_path / "out.yaml")
    text = (tmp_path / "out.yaml").read_text()
    assert "hf_s3cret" not in text and "${oc.env:COOKBOOK_TEST_SECRET}" in text
    # a process that rebuilds the config from that dict (a Ray worker) reads its own environment
    monkeypatch.setenv("COOKBOOK_TEST_SECRET", "worker_value")
    rebuilt = config_from_dict(Schema, written)
    assert rebuilt.name == "worker_value" and to_dict(rebuilt) == written
    # another token is not "other settings" on resume
    assert to_dict(load_config(Schema, f, ["optim.lr=0.5"])) == written


def test_one_lora_section_serves_every_lora_recipe_with_its_own_defaults():
    """cookbook.config's LoRA section, as PEFT takes it, and the defaults each recipe sets on it (YAML overrides them)."""
    from conftest import load_recipe
    from peft import LoraConfig as PeftLoraConfig

    from cookbook import config

    lora = config.ExpertLoraConfig(
        r=8, alpha=16, dropout=0.0, target_modules=[], target_parameters=["experts.down_proj"]
    )
    peft = PeftLoraConfig(**lora.peft_kwargs())
    assert (peft.r, peft.lora_alpha, peft.lora_dropout, peft.target_modules, peft.target_parameters) == (
        8,
        16,
        0.0,
        None,
        ["experts.down_proj"],
    )  # an empty list of targets is None for PEFT: none of that kind
    assert config.LoraConfig(dropout=0.1).peft_kwargs() == {
        "r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.1,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    }
    defaults = {}
    for name in (
        "gpt-oss-lora-trl",
        "moe-lora-fsdp2-ep",
        "moe-vl-lora-fsdp2-ep",
        "unsloth-lora-ddp",
        "qwen-zero3-receipts",
    ):
        recipe = load_recipe(name.replace("moe-vl-", "moe-"))
        section = load_config(recipe.VLConfig if name == "moe-vl-lora-fsdp2-ep" else recipe.Config).lora
        assert isinstance(section, config.LoraConfig), name
        defaults[name] = {k: v for k, v in vars(section).items() if k not in ("r", "alpha")}
        assert (section.r, section.alpha) == (16, 32), name
    attention, every_linear = ["q_proj", "k_proj", "v_proj", "o_proj"], list(config.DECODER_LINEARS)
    assert defaults == {
        "gpt-oss-lora-trl": {"dropout": 0.0, "target_modules": attention, "target_parameters": []},
        "moe-lora-fsdp2-ep": {
            "dropout": 0.0,
            "target_modules": attention,
            "expert_lora": "routed",
            "target_parameters": ["mixer.experts.up_proj", "mixer.experts.down_proj"],
        },
        "moe-vl-lora-fsdp2-ep": {
            "dropout": 0.0,
            "target_modules": attention,
            "expert_lora": "routed",
            "target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
        },
        "unsloth-lora-ddp": {"dropout": 0.0, "target_modules": every_linear},
        "qwen-zero3-receipts": {"dropout": 0.05, "target_modules": every_linear, "enabled": False},
    }
    assert isinstance(
        load_config(load_recipe("moe-lora-fsdp2-ep").Config).lora, load_recipe("moe-lora-fsdp2-ep").LoraSection
    )


def test_a_required_package_that_is_missing_or_broken_is_refused_in_one_line(tmp_path, monkeypatch):
    """`cookbook.config.require` (a recipe's --check, before any worker): the package's pin from the requirements file
    and that file's install line; an installed package whose import fails (a compiled extension built for another
    torch) is named with its version and the cause, and a torch build gets the install line of the matching build."""
    import torch

    from cookbook import config, requirements

    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# extra packages\ncookbook-no-such-package==1.2  # a comment\nbrokenpkg==1.0\n")
    missing = (
        f"cookbook_no_such_package is not installed: `pip install cookbook-no-such-package==1.2`, or "
        f"`pip install -r {reqs}`"
    )
    with pytest.raises(ConfigError) as err:
        config.require("cookbook_no_such_package", reqs)
    assert str(err.value) == missing
    with pytest.raises(
        ConfigError,
        match=r"^cookbook_no_such_package is not installed: `pip install "
        r"cookbook_no_such_package`, or `pip install -r requirements/base\.txt` from "
        r"the cookbook repository's root$",
    ):
        config.require("cookbook_no_such_package", "requirements/base.txt")
    assert [requirements.pinned(p, "requirements/base.txt") for p in ("ray[train]", "peft", "PEFT")] == [
        "ray[train]==2.60.0",
        "peft==0.21.2",
        "peft==0.21.2",
    ]

    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text(
        "raise RuntimeError('operator brokenpkg::nms does not exist')\n"
    )
    (tmp_path / "brokenpkg-1.0.dist-info").mkdir()
    (tmp_path / "brokenpkg-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: brokenpkg\nVersion: 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = "brokenpkg 1.0 is installed but does not import (RuntimeError: operator brokenpkg::nms does not exist)"
    monkeypatch.setattr(torch.version, "hip", None)
    for cuda, index in ((None, "cpu"), ("13.0", "cu130")):  # the index of the installed torch's build
        monkeypatch.setattr(torch.version, "cuda", cuda)
        with pytest.raises(ConfigError) as err:
            config.require("brokenpkg", reqs, torch_build=True)
        assert str(err.value) == (
            f"{broken}: its build does not match torch {torch.__version__}: install the "
            f"brokenpkg build made for that torch: `pip install --force-reinstall --no-deps "
            f"'brokenpkg==1.0' --index-url https://download.pytorch.org/whl/{index}`"
        )
    with pytest.raises(ConfigError) as err:
        config.require("brokenpkg", reqs)
    assert str(err.value) == f"{broken}; install it again: `pip install brokenpkg==1.0`, or `pip install -r {reqs}`"
    config.require("omegaconf", reqs)  # installed and importable: nothing to say


def test_a_dashed_override_is_refused_with_the_form_overrides_take(capsys):
    from cookbook.config import cli_parser

    with pytest.raises(SystemExit) as stop:
        cli_parser().parse_args(["--config", "c.yaml", "--max_steps", "5"])
    assert stop.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(
            "error: unrecognized arguments: --max_steps (config overrides are written key=value without dashes, "
            "e.g. train.max_steps=5)"
        )
    )
