"""The Unsloth and Axolotl recipes on CPU, without Unsloth or Axolotl in this environment (their pins conflict with
it; each recipe has its own requirements.txt): config validation, the launch scripts' dry runs, the Axolotl data set
against rows that Axolotl 0.19.0's `axolotl preprocess` built, the same LoRA settings on the three paths, and the
Unsloth recipe's TRL + PEFT path (model.loader=transformers) end to end on 2 ranks."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, check, load_recipe, main_in_workers, read_jsonl, train_losses

from cookbook import WorkerError

UNSLOTH = ROOT / "recipes" / "unsloth-lora-ddp"
AXOLOTL = ROOT / "recipes" / "axolotl-lora-ddp"


def _axolotl_check():
    name = "axolotl_lora_ddp_check"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, AXOLOTL / "check.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


PYTHON3 = Path(sys.executable).parent / "python3"  # what launch.sh runs, with this interpreter's folder first on PATH


def _dry_run(recipe_dir, *args, **env):
    path = f"{PYTHON3.parent}{os.pathsep}{os.environ['PATH']}"
    out = subprocess.run(
        ["bash", str(recipe_dir / "launch.sh"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path, "DRY_RUN": "1", **env},
        timeout=60,
    )
    return out.returncode, out.stdout.splitlines(), out.stderr


def test_unsloth_config_is_checked(monkeypatch):
    assert "loader transformers, LoRA r=16 alpha=32, seq 128" in check("unsloth-lora-ddp")
    mod = load_recipe("unsloth-lora-ddp")
    with pytest.raises(mod.ConfigError, match=r"^override 'lora.rank=8': key 'lora.rank': Key 'rank' not in"):
        check("unsloth-lora-ddp", "lora.rank=8")
    with pytest.raises(
        mod.ConfigError, match=r"tiny.yaml: model.loader must be one of unsloth, transformers, got 'trl'$"
    ):
        check("unsloth-lora-ddp", "model.loader=trl")
    with pytest.raises(mod.ConfigError, match=r"tiny.yaml: model.load_in_4bit needs model.loader=unsloth$"):
        check("unsloth-lora-ddp", "model.load_in_4bit=true")
    with pytest.raises(mod.ConfigError, match=r"tiny.yaml: lora.r must be at least 1, got 0$"):
        check("unsloth-lora-ddp", "lora.r=0")
    with pytest.raises(
        mod.ConfigError,
        match=r"tiny.yaml: model.attn_implementation must be one of auto, varlen, "
        r"sdpa, eager, got 'flash'$",
    ):
        check("unsloth-lora-ddp", "model.attn_implementation=flash")
    with pytest.raises(mod.ConfigError, match=r"tiny.yaml: model.attn_implementation=varlen runs on CUDA GPUs only"):
        check("unsloth-lora-ddp", "model.attn_implementation=varlen")  # this machine has no GPU
    with pytest.raises(mod.ConfigError, match=r"tiny.yaml: train.lr must be in \(0, inf\), got -0.0002$"):
        check("unsloth-lora-ddp", "train.lr=-2e-4")  # torch's AdamW would refuse it in every worker
    with pytest.raises(mod.ConfigError, match=r"tiny.yaml: train.warmup_steps must be >= 0, got -1$"):
        check("unsloth-lora-ddp", "train.warmup_steps=-1")
    with pytest.raises(mod.ConfigError, match=r"^model.name_or_path: folder not found: \.\./nope/llama$"):
        check("unsloth-lora-ddp", "model.name_or_path=../nope/llama")  # a path, not tried as a hub id
    tiny = mod.load(UNSLOTH / "tiny.yaml")
    assert (mod.attention(tiny, on_gpu=False), mod.attention(tiny, on_gpu=True)) == ("sdpa", "varlen")
    monkeypatch.setitem(sys.modules, "unsloth", None)  # Unsloth not installed: one line before any worker
    with pytest.raises(
        mod.ConfigError,
        match=r"tiny.yaml: model.loader=unsloth, but Unsloth does not import \(.*\): "
        r"install the recipe's own environment .*, or set model.loader=transformers$",
    ):
        check("unsloth-lora-ddp", "model.loader=unsloth")
    cfg = mod.load(UNSLOTH / "config.yaml")  # the real config passes the same checks
    assert (cfg.model.name_or_path, cfg.model.loader, cfg.lora.r) == ("meta-llama/Llama-3.2-3B", "unsloth", 16)
    assert (cfg.data.packing, cfg.model.attn_implementation) == (True, "auto")  # packed rows ship (issue 37)


def test_unsloth_launch_dry_run():
    rc, lines, _ = _dry_run(UNSLOTH, "train.max_steps=3", NGPU="4", CONFIG_FILE="tiny.yaml")
    tiny, train = UNSLOTH / "tiny.yaml", UNSLOTH / "train.py"
    assert rc == 0
    assert lines == [
        f"check: env COOKBOOK_WORLD_SIZE=4 {PYTHON3} {train} --check --config {tiny} train.max_steps=3",
        f"run: {PYTHON3} -m cookbook.torchrun --standalone --nproc-per-node 4 --max-restarts 3 {train} "
        f"--config {tiny} train.max_steps=3",
    ]


def test_axolotl_config_is_checked(tmp_path):
    chk = _axolotl_check()
    cfg = chk.load(AXOLOTL / "tiny.yaml")
    assert cfg["datasets"][0]["path"] == str(ROOT / "recipes/axolotl-lora-ddp/tiny/data/chat.jsonl")
    good = yaml.safe_load((AXOLOTL / "tiny.yaml").read_text())
    good["datasets"][0]["path"] = cfg["datasets"][0]["path"]
    (tmp_path / "folder").mkdir()
    cases = [
        (
            {"lora_rr": 8},
            "key 'lora_rr' is not an Axolotl key this recipe uses; did you mean 'lora_r'? "
            "(Axolotl would ignore it silently)",
        ),
        ({"lora_r": "16"}, "key 'lora_r' must be int, got '16'"),
        ({"adapter": "qlora"}, "key 'load_in_4bit' must be true with adapter: qlora, and only then"),
        ({"sequence_len": 0}, "key 'sequence_len' must be at least 1, got 0"),
        (
            {"datasets": [{"path": "missing.jsonl", "type": "chat_template"}]},
            f"datasets[0].path: file not found: {tmp_path / 'missing.jsonl'}",
        ),
        (
            {"datasets": [{**good["datasets"][0], "path": "folder"}]},
            f"datasets[0].path: {tmp_path / 'folder'} is a folder, not a file",
        ),
        (
            {"datasets": [{**good["datasets"][0], "type": "alpaca"}]},
            "datasets[0].type must be chat_template (chat rows), got 'alpaca'",
        ),
    ]
    for change, message in cases:
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump({**good, **change}))
        with pytest.raises(chk.ConfigError) as err:
            chk.load(bad)
        assert str(err.value) == f"{bad}: {message}"
    bad.write_text(yaml.safe_dump({k: v for k, v in good.items() if k != "lora_alpha"}))
    assert chk.main([str(bad)]) == 2
    for name in ("config.yaml", "qlora.yaml"):  # the real configs pass until their data file (prepare_data.py)
        with pytest.raises(chk.ConfigError, match=r"datasets\[0\].path: file not found: .*data/alpaca_chat.jsonl$"):
            chk.load(AXOLOTL / name)


def test_axolotl_missing_config_names_the_one_beside_check_py(tmp_path, monkeypatch, capsys):
    """A config name given from another folder: the same line as the other recipes' (the working directory, and the
    recipe's own file of that name), exit status 2."""
    chk = _axolotl_check()
    monkeypatch.chdir(tmp_path)
    message = f"config file not found: tiny.yaml (from {tmp_path}); {AXOLOTL / 'tiny.yaml'} exists: give that path"
    with pytest.raises(chk.ConfigError) as err:
        chk.load("tiny.yaml")
    assert str(err.value) == message
    assert chk.main(["tiny.yaml"]) == 2 and capsys.readouterr().err == f"error: {message}\n"
    with pytest.raises(chk.ConfigError, match=r"^config file not found: nope.yaml \(from .*\)$"):
        chk.load("nope.yaml")


def test_axolotl_dataset_equals_axolotl_preprocess():
    """check.py renders the tiny twin's rows as Axolotl 0.19.0 did: tests/data/axolotl_0.19.0_tiny_rows.json holds
    the first 8 rows of `axolotl preprocess recipes/axolotl-lora-ddp/tiny.yaml` (run once in a separate folder; all
    600 rows were equal then), input ids and labels (-100 outside the assistant turns)."""
    from transformers import AutoTokenizer

    chk = _axolotl_check()
    cfg = chk.load(AXOLOTL / "tiny.yaml")
    tokenizer = AutoTokenizer.from_pretrained(cfg["tokenizer_config"])
    rows = chk.build_dataset(cfg, tokenizer)
    expected = json.loads((ROOT / "tests/data/axolotl_0.19.0_tiny_rows.json").read_text())
    assert len(rows) == 600
    assert rows[:8] == expected
    # row 2 has a system turn: only the answer and its end-of-turn token carry a loss
    assert tokenizer.decode([t for t in rows[1]["labels"] if t != -100]) == "The colour of plum is purple.<|im_end|>"


def test_axolotl_show_examples_prints_rows_as_trained_with_the_counts(tmp_path, capsys):
    """check.py --show-examples N: N conversations per file with the labelled tokens between [[ ]], then the counts
    per field: a conversation longer than sequence_len dropped (Axolotl's excess_length_strategy default) or cut
    (truncate), reasoning the tiny template does not render counted, keys not used counted; the val_set_size split
    comes after the rows shown."""
    chk = _axolotl_check()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {
                    "messages": [
                        {"role": "user", "content": "What is 2 plus 2?"},
                        {"role": "assistant", "content": "It is 4.", "reasoning_content": "2 + 2 = 4.", "weight": 1},
                    ]
                },
                {
                    "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there."}],
                    "id": 2,
                },
                {
                    "messages": [
                        {"role": "user", "content": "Count."},
                        {"role": "assistant", "content": " ".join(["one"] * 200)},
                    ]
                },
            ]
        )
    )
    cfg = yaml.safe_load((AXOLOTL / "tiny.yaml").read_text())
    cfg.update(
        datasets=[{**cfg["datasets"][0], "path": str(rows)}],
        val_set_size=0.5,
        base_model=str(AXOLOTL / "tiny/olmo3"),
        tokenizer_config=str(AXOLOTL / "tiny/llama"),
    )
    path = tmp_path / "show.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert chk.main([str(path), "--show-examples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("labelled tokens (in the loss) are between [[ and ]]\n")
    assert "--- rows.jsonl example 1 of 2 (line 1, " in out and "--- rows.jsonl example 2 of 2 (line 2, " in out
    assert "[[It is 4.<|im_end|>]]" in out and "[[Hi there.<|im_end|>]]" in out
    assert "  examples        2 kept, 1 dropped (longer than max_length=128, dropped rather than cut: line 3 (" in out
    assert "  reasoning       0 turns trained, 1 left out by the chat template\n" in out  # no drop count: train
    assert "  keys not used   id: 1, messages[].weight: 1" in out
    assert out.rstrip().endswith(
        "val_set_size=0.5: Axolotl holds out that share of these examples for evaluation "
        "(seed 42); the rows above are before that split"
    )
    path.write_text(yaml.safe_dump({**cfg, "excess_length_strategy": "truncate"}))
    assert chk.main([str(path), "--show-examples", "1"]) == 0
    assert "  examples        3 kept, 1 truncated to max_length=128, 0 dropped" in capsys.readouterr().out
    path.write_text(yaml.safe_dump({**cfg, "excess_length_strategy": "raise"}))
    assert chk.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {rows} line 3: ") and err.endswith(
        " tokens, longer than sequence_len=128 (excess_length_strategy: raise)\n"
    )


def test_axolotl_launch_dry_run():
    rc, lines, _ = _dry_run(AXOLOTL, "--max-steps", "5", NGPU="2", CONFIG_FILE="qlora.yaml")
    assert rc == 0
    assert lines == [
        f"check: python3 {AXOLOTL}/check.py {AXOLOTL}/qlora.yaml ",
        f"run (in {AXOLOTL}): axolotl train {AXOLOTL}/qlora.yaml --launcher torchrun --max-steps 5 -- "
        "--nproc_per_node 2 --nnodes 1 ",
    ]
    rc, lines, _ = _dry_run(AXOLOTL, NGPU="8", LAUNCHER="accelerate")
    assert lines[1].endswith("--launcher accelerate -- --num_processes 8 --num_machines 1 ")
    rc, _, err = _dry_run(AXOLOTL, LAUNCHER="deepspeed", NGPU="1")
    assert (rc, err) == (2, "error: LAUNCHER must be torchrun or accelerate, got 'deepspeed'\n")


def _assert_same_training(a: dict, u, seq: int | None = None, steps: int | None = None) -> None:
    """Axolotl config `a` has the LoRA, batch, schedule and checkpointing of the Unsloth / TRL config `u` (with the
    sequence length and steps `seq` / `steps` when given, as the benchmark script overrides them)."""
    assert (a["lora_r"], a["lora_alpha"], a["lora_dropout"], a["lora_target_modules"]) == (
        u.lora.r,
        u.lora.alpha,
        u.lora.dropout,
        u.lora.target_modules,
    )
    assert (a["sequence_len"], a["sample_packing"], a["micro_batch_size"], a["gradient_accumulation_steps"]) == (
        seq or u.data.max_length,
        u.data.packing,
        u.train.micro_batch_size,
        u.train.grad_accum_steps,
    )
    assert (
        a["max_steps"],
        a["learning_rate"],
        a["warmup_steps"],
        a["lr_scheduler"],
        a["weight_decay"],
        a["max_grad_norm"],
        a["seed"],
        a["gradient_checkpointing"],
    ) == (
        steps or u.train.max_steps,
        u.train.lr,
        u.train.warmup_steps,
        u.train.scheduler,
        u.train.weight_decay,
        u.train.max_grad_norm,
        u.train.seed,
        u.train.gradient_checkpointing,
    )


@pytest.mark.parametrize(
    "unsloth_cfg, axolotl_cfgs", [("config.yaml", ["config.yaml", "qlora.yaml"]), ("tiny.yaml", ["tiny.yaml"])]
)
def test_same_settings_on_every_path(unsloth_cfg, axolotl_cfgs):
    """Unsloth (model.loader=unsloth), the TRL + PEFT path (the same train.py, model.loader=transformers) and Axolotl
    train with the same LoRA, sequence length, batch, steps and schedule."""
    u = load_recipe("unsloth-lora-ddp").load(UNSLOTH / unsloth_cfg)
    for name in axolotl_cfgs:
        _assert_same_training(yaml.safe_load((AXOLOTL / name).read_text()), u)
    if unsloth_cfg == "tiny.yaml":  # the same rows (each folder holds its copy), converted alike
        a = _axolotl_check().load(AXOLOTL / "tiny.yaml")
        assert [Path(f).read_bytes() for f in u.data.train_files] == [Path(a["datasets"][0]["path"]).read_bytes()]


def test_prepare_data_matches_the_unsloth_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("axolotl_prepare_data", AXOLOTL / "prepare_data.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    src = ROOT / "recipes/qwen-fsdp2-sft/tiny/data/alpaca.json"
    n = prep.convert(str(src), str(tmp_path / "chat.jsonl"))
    u = load_recipe("unsloth-lora-ddp")
    cfg = u.load(UNSLOTH / "tiny.yaml", [f"data.train_files=[{src}]"])
    rows, _ = u.training_rows(cfg)
    chats = [r["messages"] for r in read_jsonl(tmp_path / "chat.jsonl")]
    assert n == len(rows) == 200
    assert chats == [r["prompt"] + r["completion"] for r in rows]


THINK = {
    "messages": [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four.", "reasoning_content": "Two plus two: four."},
    ],
    "id": 7,
}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "day": {"type": "string"}}},
        },
    }
]


def _call(args):
    return {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": args}}],
            },
            {"role": "tool", "content": "18 C"},
            {"role": "assistant", "content": "It is 18 C.", "thinking": "The tool said 18."},
        ],
        "tools": WEATHER,
    }


def test_unsloth_trl_rows_keep_reasoning_and_tools_as_trl_trains_them(tmp_path):
    """The TRL path keeps an answer's reasoning (rendered by a template that reads it, Qwen3's, and in the loss),
    the row's tools and tool calls (each call's arguments as written: no other row's keys as nulls), counts what it
    drops or does not use, and refuses reasoning a template has no place for in one line. TRL's own SFTTrainer
    data set equals what --show-examples shows (trl_examples)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    from trl import SFTConfig, SFTTrainer

    from cookbook.sft import SFTDataError

    u = load_recipe("unsloth-lora-ddp")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (THINK, _call({"city": "Paris"}), _call({"day": "Mon"}))))
    qwen3 = ROOT / "recipes/qwen-fsdp2-sft/tiny/qwen3"
    cfg = u.load(UNSLOTH / "tiny.yaml", [f"data.train_files=[{data}]", "data.max_length=1024"])
    tok = AutoTokenizer.from_pretrained(qwen3)
    rows, parts = u.training_rows(cfg, tok)
    ((examples, st),) = u.trl_examples(rows, parts, tok, cfg)
    labelled = [tok.decode([t for t in e["labels"] if t != -100]) for e in examples]
    assert labelled[0] == "<think>\nTwo plus two: four.\n</think>\n\nIt is four.<|im_end|>\n"
    assert labelled[1] == "<think>\nThe tool said 18.\n</think>\n\nIt is 18 C.<|im_end|>\n"
    assert '"arguments": {"city": "Paris"}' in tok.decode(examples[1]["input_ids"])
    assert '"arguments": {"day": "Mon"}' in tok.decode(examples[2]["input_ids"])
    assert (st.reasoning_turns, st.tool_call_rows, st.tool_calls, st.ignored) == (3, 2, 2, {"id": 1})
    assert "reasoning: 3 turns trained" in st.summary() and "keys not used: id (1)" in st.summary()

    model = Qwen3ForCausalLM(Qwen3Config.from_pretrained(qwen3))
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_length=1024,
        completion_only_loss=True,
        use_cpu=True,
        report_to="none",
        dataset_num_proc=None,
    )
    trained = SFTTrainer(model=model, args=args, train_dataset=u.trl_dataset(rows), processing_class=tok).train_dataset
    assert [(r["input_ids"], r["labels"]) for r in trained] == [(e["input_ids"], e["labels"]) for e in examples]

    llama = AutoTokenizer.from_pretrained(ROOT / "recipes/qwen-fsdp2-sft/tiny/llama")  # reads no reasoning field
    with pytest.raises(
        SFTDataError,
        match=r"rows\.jsonl line 1: messages\[1\] has reasoning, but the chat template "
        r"has no place for it .*set data\.reasoning=drop",
    ):
        u.training_rows(cfg, llama)
    drop = u.load(UNSLOTH / "tiny.yaml", [f"data.train_files=[{data}]", "data.reasoning=drop"])
    _, parts = u.training_rows(drop, llama)
    assert sum(len(turns) for turns in parts[0][1]) == 3
    thinking = tmp_path / "think.jsonl"  # llama's template renders no tools: rows without them
    thinking.write_text(json.dumps(THINK) + "\n")
    for max_length, kept in ((1024, (1, 0, 1)), (8, (0, 1, 0))):  # 8 tokens: no label left, the row is dropped
        over = [f"data.train_files=[{thinking}]", "data.reasoning=drop", f"data.max_length={max_length}"]
        cut = u.load(UNSLOTH / "tiny.yaml", over)
        ((_, st),) = u.trl_examples(*u.training_rows(cut, llama), llama, cut)
        assert (st.examples, st.dropped, st.reasoning_dropped) == kept  # counted for what training keeps
    with pytest.raises(u.ConfigError, match=r"data\.reasoning must be train or drop, got 'context': TRL's"):
        u.load(UNSLOTH / "tiny.yaml", ["data.reasoning=context"])


# ----------------------------------------------------------------------------- the TRL path on 2 ranks
@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """``data.train_files`` of the tiny twin's first 64 rows (6 steps take 48): TRL tokenizes every row in every
    worker. DeepSpeed is imported here once, inherited by the forked workers: transformers' ``save_pretrained``
    imports it (~3 s) when it is installed."""
    import deepspeed  # noqa: F401

    path = tmp_path_factory.mktemp("data") / "chat64.jsonl"
    lines = (ROOT / "recipes/qwen-fsdp2-sft/tiny/data/chat.jsonl").read_text().splitlines()
    path.write_text("\n".join(lines[:64]) + "\n")
    return f"data.train_files=[{path}]"


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory, rows):
    """model.loader=transformers on 2 ranks: one uninterrupted run (6 steps, checkpoints at 3 and 6), and one
    stopped at step 3 (train.stop_at_step) then run again with the same command (checkpoint.resume=auto)."""
    full, resumed = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("resumed")
    main_in_workers("unsloth-lora-ddp", f"output_dir={full}", rows)
    main_in_workers("unsloth-lora-ddp", f"output_dir={resumed}", rows, "train.stop_at_step=3")
    stopped = train_losses(resumed / "metrics.jsonl")
    main_in_workers("unsloth-lora-ddp", f"output_dir={resumed}", rows)
    return full, resumed, stopped


def test_unsloth_recipe_trl_path_trains(trl_runs):
    """model.loader=transformers (AutoModelForCausalLM + PEFT under TRL's SFTTrainer) on 2 ranks: the loss falls,
    the metrics count tokens, and the adapter has the config's LoRA settings."""
    out = trl_runs[0]
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert train[-1]["loss"] < train[0]["loss"] - 0.1
    assert all(r["tokens_per_s_per_device"] > 0 for r in train)
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (16, 32, 0.0)
    assert sorted(adapter["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert (out / "final" / "model.safetensors").is_file()  # checkpoint.export_merged: the base with the adapter merged


def test_unsloth_recipe_trl_path_compiled_layers_train_as_eager(trl_runs, rows, tmp_path, monkeypatch):
    """train.compile=true (each decoder layer a torch.compile region; aot_eager here, inductor on a GPU): the
    eager run's per-step losses."""
    train = load_recipe("unsloth-lora-ddp")
    monkeypatch.setattr(train, "COMPILE_BACKEND", "aot_eager")  # inherited by the forked workers
    main_in_workers("unsloth-lora-ddp", f"output_dir={tmp_path}", rows, "train.compile=true", "train.stop_at_step=2")
    compiled, eager = train_losses(tmp_path / "metrics.jsonl"), train_losses(trl_runs[0] / "metrics.jsonl")
    assert sorted(compiled) == [1, 2]  # step 2's loss follows step 1's compiled backward
    for step, loss in compiled.items():
        assert loss == pytest.approx(eager[step], rel=1e-5), step


def test_unsloth_recipe_resume_equals_uninterrupted(trl_runs):
    full, resumed, stopped = trl_runs
    assert sorted(stopped) == [1, 2, 3]
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["checkpoint-3", "checkpoint-6"]
    # the second run continued at step 4 (a fresh start would have logged steps 1-6 again)
    assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl") if r["event"] == "train"] == list(range(1, 7))
    want, got = train_losses(full / "metrics.jsonl"), train_losses(resumed / "metrics.jsonl")
    assert [got[s] for s in range(1, 7)] == pytest.approx([want[s] for s in range(1, 7)], rel=1e-5, abs=1e-6)
    assert got[6] < got[1] - 0.1


NAN_AT = {"forward": 0}  # the training forward (1-based, one per step here) that rank 1 makes NaN; 0: none


@pytest.fixture
def nan_on_rank_1(monkeypatch):
    """Rank 1's training forward number ``NAN_AT["forward"]`` returns its outputs times NaN (every floating-point
    output with a gradient: TRL computes the loss from the model's log-probabilities); patched here, before the
    workers are forked from this process. The NaN reaches rank 0 through DDP's gradient all-reduce."""
    from torch.nn.parallel import DistributedDataParallel

    forward, calls = DistributedDataParallel.forward, []

    def nan_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training:
            calls.append(1)
            if os.environ.get("RANK") == "1" and len(calls) == NAN_AT["forward"]:
                for key, value in out.items():
                    if torch.is_tensor(value) and value.is_floating_point() and value.requires_grad:
                        out[key] = value * float("nan")
        return out

    monkeypatch.setattr(DistributedDataParallel, "forward", nan_forward)
    yield NAN_AT
    NAN_AT["forward"] = 0


def test_unsloth_recipe_skips_a_nan_step_and_a_resume_continues_the_count(tmp_path, capfd, nan_on_rank_1, rows):
    """train.on_nonfinite=skip: step 2's NaN (rank 1 only) is found on both ranks, its optimizer step left out
    (the adapter and the optimizer state after step 2 are those after step 1) and counted; the count is in the
    checkpoint, and the resumed run goes on from it: step 3 trains, and step 4's NaN, with
    train.max_consecutive_skips=0, stops the run (exit status 4) naming the checkpoint from before it."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    run = (
        f"output_dir={out}",
        rows,
        "train.max_steps=4",
        "train.on_nonfinite=skip",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=0",
        "checkpoint.export_merged=false",
    )
    nan_on_rank_1["forward"] = 2  # step 2
    main_in_workers("unsloth-lora-ddp", *run, "train.stop_at_step=2")
    assert (
        "step 2: non-finite gradients, optimizer step left out, step skipped (1 skipped so far)"
        in capfd.readouterr().err
    )
    ckpt = out / "checkpoints"
    assert json.loads((ckpt / "checkpoint-2" / "meta.json").read_text())["skipped_steps"] == 1
    one, two = (load_file(ckpt / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (1, 2))
    assert len(one) == 28 and one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    opt1, opt2 = (torch.load(ckpt / f"checkpoint-{s}" / "optimizer.pt", weights_only=True)["state"] for s in (1, 2))
    assert len(opt1) == 28 and all(torch.equal(opt1[i][k], opt2[i][k]) for i in opt1 for k in ("exp_avg", "step"))

    nan_on_rank_1["forward"] = 2  # the resumed run's second step: step 4
    with pytest.raises(WorkerError) as failed:
        main_in_workers("unsloth-lora-ddp", *run, "train.max_consecutive_skips=0")  # resumes from checkpoint-2
    assert failed.value.exc_type == "cookbook.loop.NonFiniteError" and failed.value.exception.exit_status == 4
    assert str(failed.value.exception) == (
        f"the gradients of step 4 are not finite on every rank (the optimizer step was left out): the step was not "
        f"applied, and that makes 1 non-finite steps in a row (train.max_consecutive_skips=0), so the run stops; the "
        f"newest checkpoint, from before it, is {ckpt / 'checkpoint-3'}. Lower optim.lr or raise the warm-up, or "
        f"check the data"
    )
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert [(r["step"], r["skipped_steps"]) for r in train] == [(1, 0), (2, 1), (3, 1)]
    assert all(math.isfinite(r["loss"]) for r in train)
    assert json.loads((ckpt / "checkpoint-3" / "meta.json").read_text())["skipped_steps"] == 1
    three = load_file(ckpt / "checkpoint-3" / "adapter_model.safetensors")
    assert any(not torch.equal(two[k], three[k]) for k in two)  # step 3 was applied


def test_unsloth_recipe_epochs_read_every_row_once(tmp_path, capfd, monkeypatch):
    """train.max_steps=-1 train.epochs=2 on 2 ranks, 20 rows, global batch 4 x 1 x 2 = 8: 2 steps per epoch, each
    of 8 distinct rows, each epoch 16 distinct rows (4 left out, said in the log). The Trainer's own sampler read
    3 steps per epoch there, one of them padded with 4 rows read twice."""
    import re

    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoTokenizer

    data = tmp_path / "numbered.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Question number {i}?"},
                        {"role": "assistant", "content": f"Answer {i}."},
                    ]
                }
            )
            + "\n"
            for i in range(20)
        )
    )
    seen, forward = tmp_path / "seen", DistributedDataParallel.forward

    def recording_forward(self, *args, **kwargs):
        if self.training:
            with open(f"{seen}-{os.environ['RANK']}", "a") as f:
                f.write(json.dumps(kwargs["input_ids"].tolist()) + "\n")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DistributedDataParallel, "forward", recording_forward)
    run = (
        f"output_dir={tmp_path / 'run'}",
        f"data.train_files=[{data}]",
        "train.max_steps=-1",
        "train.epochs=2",
        "checkpoint.every_steps=0",
        "checkpoint.export_merged=false",
    )
    main_in_workers("unsloth-lora-ddp", *run)
    assert (
        "epoch: 20 rows = 2 steps of 8 rows, every row read once; the last partial global batch (4 rows, "
        "others each epoch) is dropped" in capfd.readouterr().err
    )
    main_in_workers("unsloth-lora-ddp", *run)  # the step count (4) known once TRL has the rows: already complete
    assert "already complete" in capfd.readouterr().err
    tok = AutoTokenizer.from_pretrained(ROOT / "recipes/qwen-fsdp2-sft/tiny/llama")
    per_rank = [
        [
            [int(re.search(r"number (\d+)", tok.decode(ids)).group(1)) for ids in json.loads(line)]
            for line in Path(f"{seen}-{r}").read_text().splitlines()
        ]
        for r in (0, 1)
    ]
    steps = [a + b for a, b in zip(*per_rank)]
    assert [len(s) for s in steps] == [8, 8, 8, 8] and all(len(set(s)) == 8 for s in steps)
    for epoch in (steps[:2], steps[2:]):
        assert len(set(sum(epoch, []))) == 16
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["event"] == "train"] == [1, 2, 3, 4]


def _bench_config():
    name = "axolotl_bench_config"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "axolotl_bench_config.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_benchmark_axolotl_yaml_has_the_trl_path_settings():
    """benchmarks/unsloth_axolotl_vs_trl.sh's Axolotl YAML trains as its TRL path does (config.yaml with the script's
    overrides: seq, steps, micro-batch 4, packing, gradient checkpointing): packed bins padded to seq through sdpa
    (varlen_attn), or unpacked rows padded to the batch's longest."""
    u = load_recipe("unsloth-lora-ddp").load(UNSLOTH / "config.yaml")
    a = _bench_config().axolotl_config(
        "/m", "/d.jsonl", "/r", seq=2048, steps=40, cpu=False, pad_token="<eos>", packing=True
    )
    _assert_same_training(a, u, seq=2048, steps=40)
    assert (a["pad_to_sequence_len"], a["attn_implementation"], a["bf16"]) == (True, "sdpa", True)
    unpacked = _bench_config().axolotl_config("/m", "/d.jsonl", "/r", seq=2048, steps=40, cpu=False, pad_token=None)
    assert (unpacked["sample_packing"], unpacked["pad_to_sequence_len"], "attn_implementation" in unpacked) == (
        False,
        False,
        False,
    )
    assert a["gradient_checkpointing"] and a["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert a["optimizer"] == "adamw_torch_fused" and a["special_tokens"] == {"pad_token": "<eos>"}
    assert "lora_mlp_kernel" not in a  # Axolotl's default on a GPU
    cpu = _bench_config().axolotl_config("/m", "/d.jsonl", "/r", seq=128, steps=4, cpu=True, pad_token=None)
    assert not cpu["bf16"] and cpu["lora_mlp_kernel"] is False and "special_tokens" not in cpu


def test_benchmark_axolotl_qlora_yaml_and_attention_kernels():
    """The QLoRA variant of the benchmark's Axolotl YAML differs from the LoRA one only in adapter and 4-bit loading
    (recipes/axolotl-lora-ddp/qlora.yaml's keys), and a model whose attention Axolotl's QKV/O kernels cannot patch
    keeps the MLP kernel only; an unknown adapter is refused."""
    b = _bench_config()
    lora = b.axolotl_config("/m", "/d.jsonl", "/r", seq=2048, steps=30, cpu=False, pad_token=None)
    q = b.axolotl_config(
        "/m",
        "/d.jsonl",
        "/r",
        seq=2048,
        steps=30,
        cpu=False,
        pad_token=None,
        adapter="qlora",
        prepared="/p",
        attn_kernels=False,
    )
    recipe = yaml.safe_load((AXOLOTL / "qlora.yaml").read_text())
    assert (q["adapter"], q["load_in_4bit"]) == (recipe["adapter"], recipe["load_in_4bit"]) == ("qlora", True)
    assert q["dataset_prepared_path"] == "/p" and lora["dataset_prepared_path"] == "/r/prepared"
    assert (q["lora_qkv_kernel"], q["lora_o_kernel"], q["lora_mlp_kernel"]) == (False, False, True)
    differ = {k for k in set(q) | set(lora) if q.get(k) != lora.get(k)}
    assert differ == {
        "adapter",
        "load_in_4bit",
        "dataset_prepared_path",
        "lora_qkv_kernel",
        "lora_o_kernel",
        "lora_mlp_kernel",
    }
    cpu = b.axolotl_config("/m", "/d.jsonl", "/r", seq=128, steps=4, cpu=True, pad_token=None, attn_kernels=False)
    assert cpu["lora_mlp_kernel"] is False  # no Triton kernel on CPU
    with pytest.raises(ValueError, match="adapter"):
        b.axolotl_config("/m", "/d.jsonl", "/r", seq=128, steps=4, cpu=True, pad_token=None, adapter="dora")


def test_olmo3_tokenizer_refuses_a_small_vocabulary(tmp_path):
    """benchmarks/olmo3_tokenizer.py keeps Llama-3's cl100k_base ids 0..100255: a tokenizer with fewer ordinary
    tokens (the 512-id tiny Llama one) is refused with ValueError, and nothing is written."""
    spec = importlib.util.spec_from_file_location("olmo3_tokenizer", ROOT / "benchmarks" / "olmo3_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (mod.BASE_IDS, mod.VOCAB_SIZE) == (100256, 100278)
    assert json.loads((AXOLOTL / "models" / "olmo-3-7b" / "config.json").read_text())["vocab_size"] == mod.VOCAB_SIZE
    assert max(mod.SPECIALS.values()) < mod.VOCAB_SIZE and min(mod.SPECIALS.values()) >= mod.BASE_IDS
    with pytest.raises(ValueError, match="100256"):
        mod.build(str(ROOT / "recipes" / "qwen-fsdp2-sft" / "tiny" / "llama"), str(tmp_path / "tok"))
    assert not (tmp_path / "tok").exists()


def test_axolotl_metrics_plugin_counts_real_tokens(tmp_path):
    """The Axolotl plugin, attached to a plain HF Trainer (no Axolotl here), writes one train record per step whose
    tokens are the batch's non-zero attention_mask entries (packed bins number their documents 1, 2, ...), and a
    summary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    sys.path.insert(0, str(AXOLOTL))
    try:
        from cookbook_metrics import CookbookMetricsPlugin
    finally:
        sys.path.remove(str(AXOLOTL))
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    lengths = [5, 9, 3, 7]  # two batches of 2: 14 and 10 real tokens; 3 and 7 as Axolotl's packed mask (1, 2, 0)
    rows = [
        {
            "input_ids": torch.arange(1, 10),
            "attention_mask": (torch.arange(9) < n).long() * (1 + (torch.arange(9) >= 2) * (i >= 2)),
            "labels": torch.where(torch.arange(9) < n, torch.arange(1, 10), -100),
        }
        for i, n in enumerate(lengths)
    ]
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.get_train_dataloader = lambda: torch.utils.data.DataLoader(
        rows, batch_size=2, collate_fn=lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]}
    )
    CookbookMetricsPlugin().post_trainer_create(None, trainer)
    trainer.train()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in recs if r["event"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert [round(r["tokens_per_s"] * r["step_time_s"]) for r in train] == [14, 10]
    assert all(r["loss"] > 3.0 for r in train)  # ln(64) ~ 4.16 at random init
    assert recs[-1]["event"] == "summary" and recs[-1]["loader"] == "axolotl"
