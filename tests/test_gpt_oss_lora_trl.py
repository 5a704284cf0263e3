"""recipes/gpt-oss-lora-trl on 2 CPU ranks (forked workers): the tiny gpt_oss twin trained with TRL's SFTTrainer +
PEFT under DDP. One uninterrupted run and one stopped at step 4 then resumed are shared by the assertions: loss falls,
the resumed run's per-step losses equal the uninterrupted run's, the exported adapter (attention projections and
experts) and the merged model give the logits of the trained model rebuilt from the last checkpoint; plus the
final-channel label mask (decoded) and the refusal of a bad row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, check, load_recipe, main_in_workers, read_jsonl
from safetensors.torch import load_file

from cookbook import WorkerError

RECIPE = ROOT / "recipes" / "gpt-oss-lora-trl"
TINY = RECIPE / "tiny"


def _train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"}


EXPERTS = "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"  # LoRA on the experts too


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    full, resumed = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("resumed")
    main_in_workers("gpt-oss-lora-trl", f"output_dir={full}", EXPERTS)
    main_in_workers("gpt-oss-lora-trl", f"output_dir={resumed}", EXPERTS, "train.stop_at_step=4")
    stopped = _train_losses(resumed)
    main_in_workers("gpt-oss-lora-trl", f"output_dir={resumed}", EXPERTS)
    return full, resumed, stopped


def test_loss_falls(runs):
    losses = _train_losses(runs[0])
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 0.2


def test_resume_equals_uninterrupted(runs):
    full, resumed, stopped = runs
    assert sorted(stopped) == [1, 2, 3, 4]
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-4",
        "checkpoint-8",
    ]
    want, got = _train_losses(full), _train_losses(resumed)
    # the second run continued at step 5 (a run started afresh would log steps 1-8 again, with the same losses)
    assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl") if r["event"] == "train"] == list(range(1, 9))
    assert [got[s] for s in range(1, 9)] == pytest.approx([want[s] for s in range(1, 9)], rel=1e-5, abs=1e-6)


def test_checkpointing_only_the_experts_leaves_the_losses_equal(runs, tmp_path):
    # train.activation_checkpointing=experts recomputes each layer's MoE block in backward: the same numbers
    main_in_workers(
        "gpt-oss-lora-trl",
        f"output_dir={tmp_path}",
        EXPERTS,
        "train.activation_checkpointing=experts",
        "train.stop_at_step=3",
    )
    want, got = _train_losses(runs[0]), _train_losses(tmp_path)
    assert sorted(got) == [1, 2, 3]
    assert [got[s] for s in (1, 2, 3)] == pytest.approx([want[s] for s in (1, 2, 3)], rel=1e-5, abs=1e-6)


def test_compiled_layers_train_as_eager(runs, tmp_path, monkeypatch):
    # train.compile=true: each decoder layer a torch.compile region (aot_eager here, inductor on a GPU)
    monkeypatch.setattr(load_recipe("gpt-oss-lora-trl"), "COMPILE_BACKEND", "aot_eager")  # the forked workers' too
    main_in_workers("gpt-oss-lora-trl", f"output_dir={tmp_path}", EXPERTS, "train.compile=true", "train.stop_at_step=2")
    want, got = _train_losses(runs[0]), _train_losses(tmp_path)
    assert sorted(got) == [1, 2]
    assert [got[1], got[2]] == pytest.approx([want[1], want[2]], rel=1e-5, abs=1e-6)


def _base_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(42)  # the recipe's random init (model.pretrained=false, train.seed=42)
    return AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(TINY / "gpt_oss", attn_implementation="eager"), dtype=torch.float32
    )


def test_adapter_reloads_with_equal_logits(runs):
    """The exported adapter and the merged export are the trained model of the run's last checkpoint (step 8)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = runs[0]
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], sorted(adapter["target_modules"]), adapter["target_parameters"]) == (
        8,
        16,
        ["k_proj", "o_proj", "q_proj", "v_proj"],
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    last = out / "checkpoints" / "checkpoint-8"
    saved, exported = (
        load_file(last / "adapter_model.safetensors"),
        load_file(out / "adapter" / "adapter_model.safetensors"),
    )
    assert sorted(exported) == sorted(saved) and len(saved) > 10
    for name, tensor in saved.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)
    trained = PeftModel.from_pretrained(_base_model(), last).eval()
    reloaded = PeftModel.from_pretrained(_base_model(), out / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "final", attn_implementation="eager").eval()
    ids = torch.randint(0, 700, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        t, a, b = trained(input_ids=ids).logits, reloaded(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = reloaded.get_base_model()  # the adapter changed the model
        with reloaded.disable_adapter():
            c = plain(input_ids=ids).logits
    torch.testing.assert_close(a, t, rtol=0, atol=0)  # the same weights, the same float32 computation
    torch.testing.assert_close(b, t, rtol=1e-4, atol=1e-5)  # merging rounds W + B @ A to float32
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert (a - c).abs().max() > 1e-3


def test_tool_calls_of_rows_dropped_by_max_length_are_not_counted_as_trained():
    """Issue 34: rows cut before their answer by data.max_length (within max_dropped_fraction) train none of their
    tool calls; the summary counts them apart."""
    from transformers import AutoTokenizer

    mod = load_recipe("gpt-oss-lora-trl")
    tokenizer = AutoTokenizer.from_pretrained(TINY / "gpt_oss")
    path = TINY / "data" / "chat.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for m in (m for row in rows for m in row["messages"] if m.get("tool_calls")):
        m.setdefault("thinking", "Ask the tool.")  # the template leaves a tool call's thinking out: counted apart
    calls = [sum(len(m.get("tool_calls") or ()) for m in row["messages"]) for row in rows]
    examples, _ = mod.tokenize_rows(rows, tokenizer, mod.DataConfig(max_length=512), path.name)  # one per row
    answer_at = max(e["labels"].index(next(x for x in e["labels"] if x != -100)) for e, c in zip(examples, calls) if c)
    cfg = mod.DataConfig(max_length=answer_at, max_dropped_fraction=0.5)  # a tool row's answer starts at the cut
    _, stats = mod.tokenize_rows(rows, tokenizer, cfg, path.name)
    kept = sorted(set(stats.example_rows))
    assert stats.dropped >= 1 and any(calls[n - 1] for n, _ in stats.dropped_rows)
    assert (stats.tool_calls, stats.tool_call_rows) == (
        sum(calls[n - 1] for n in kept),
        sum(calls[n - 1] > 0 for n in kept),
    )
    assert stats.tool_calls_cut == sum(calls[n - 1] for n, _ in stats.dropped_rows)
    assert f"{stats.tool_calls_cut} more not trained (dropped or cut at max_length)" in stats.summary()
    # the thinking the template leaves out (a tool call's) or data.reasoning=drop removes: of kept rows only
    answers = [mod._answers(row["messages"]) for row in rows]
    hidden = [
        sum(bool(m.get("thinking")) and i not in a and i < a[-1] for i, m in enumerate(row["messages"]))
        for row, a in zip(rows, answers)
    ]
    assert any(hidden[n - 1] for n, _ in stats.dropped_rows) and stats.reasoning_unrendered == sum(
        hidden[n - 1] for n in kept
    )
    _, dropping = mod.tokenize_rows(
        rows, tokenizer, mod.DataConfig(max_length=answer_at, max_dropped_fraction=0.5, reasoning="drop"), path.name
    )
    thinking = [
        sum(bool(m.get("thinking")) and i <= a[-1] for i, m in enumerate(row["messages"]))
        for row, a in zip(rows, answers)
    ]
    assert dropping.reasoning_dropped == sum(thinking[n - 1] for n in sorted(set(dropping.example_rows)))


def test_labels_are_the_final_channel_only():
    from transformers import AutoTokenizer

    mod = load_recipe("gpt-oss-lora-trl")
    tokenizer = AutoTokenizer.from_pretrained(TINY / "gpt_oss")
    path = TINY / "data" / "chat.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    cfg = mod.DataConfig(train_files=[str(path)], max_length=512)
    examples, stats = mod.tokenize_rows(rows, tokenizer, cfg, path.name)
    assert (stats.rows, stats.examples) == (28, 28)
    # the harmony template drops a tool call's thinking when an answer follows (6 rows): counted, not silent
    assert (stats.reasoning_turns, stats.reasoning_unrendered) == (22, 6)
    calls = [sum(len(m.get("tool_calls") or ()) for m in row["messages"]) for row in rows]
    assert (stats.tool_call_rows, stats.tool_calls) == (sum(c > 0 for c in calls), sum(calls)) and sum(calls) > 0
    assert stats.tool_calls_note() in stats.summary()
    with_tools = 0
    for row, ex in zip(rows, examples):
        want = row["messages"][-1]["content"] + "<|return|>"
        got = tokenizer.decode([t for t, label in zip(ex["input_ids"], ex["labels"]) if label != -100])
        assert got == want
        text = tokenizer.decode(ex["input_ids"])  # what the mask left out is rendered: thinking, tool calls, effort
        last = row["messages"][-1]
        if last.get("thinking"):
            assert f"<|channel|>analysis<|message|>{last['thinking']}<|end|>" in text
        for m in row["messages"]:
            for call in m.get("tool_calls") or []:
                with_tools += 1
                assert (
                    f"<|start|>assistant to=functions.{call['function']['name']}<|channel|>commentary json<|message|>"
                    in text
                )
        assert f"Reasoning: {row.get('reasoning_effort', 'medium')}\n" in text
    assert with_tools == 12
    # cut inside the final channel: the labels run to the cut
    ids = examples[1]["input_ids"]
    assert mod.final_channel_labels(ids[:-3], tokenizer)[-1] == ids[-4]
    # data.reasoning=train labels the answer's analysis message too
    (ex,), _ = mod.tokenize_rows(rows[1:2], tokenizer, mod.DataConfig(max_length=512, reasoning="train"), path.name)
    assert (
        tokenizer.decode([t for t, label in zip(ex["input_ids"], ex["labels"]) if label != -100])
        == rows[1]["messages"][-1]["thinking"] + "<|end|>" + rows[1]["messages"][-1]["content"] + "<|return|>"
    )


def test_tiny_template_renders_as_the_official_harmony_one_token_by_token():
    """A multi-turn row with a developer message and a tool call, rendered by the tiny twin's template, equals the
    text the official openai/gpt-oss template writes (harmony format), token by token; each answer is one example
    that ends in <|return|> with its own thinking; a row ending in a tool call gets the true reason."""
    import datetime

    from transformers import AutoTokenizer

    mod = load_recipe("gpt-oss-lora-trl")
    tok = AutoTokenizer.from_pretrained(TINY / "gpt_oss")
    weather = {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    row = {
        "tools": [weather],
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": "5.", "thinking": "2 + 3 = 5."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "thinking": "Look it up.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
                ],
            },
            {"role": "tool", "content": '{"sky": "snow"}'},
            {"role": "assistant", "content": "Snow.", "thinking": "The tool says snow."},
        ],
    }
    messages, tools = mod.harmony_conversation(row, 1, "t.jsonl")
    today = datetime.date.today().strftime("%Y-%m-%d")
    official = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
        f"2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. "
        "Channel must be included for every message.\nCalls to these tools must go to the commentary channel: "
        "'functions'.<|end|><|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Current weather of a city.\ntype get_weather = (_: {\ncity: string,\n}) => any;"
        "\n\n} // namespace functions<|end|><|start|>user<|message|>What is 2 plus 3?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>5.<|end|>"  # an earlier answer: no thinking, <|end|>
        "<|start|>user<|message|>Weather in Oslo?<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"sky\\": \\"snow\\"}"<|end|>'
        "<|start|>assistant<|channel|>analysis<|message|>The tool says snow.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Snow.<|return|>"
    )
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    assert list(ids) == tok.encode(official, add_special_tokens=False)
    examples, st = mod.tokenize_rows([row], tok, mod.DataConfig(max_length=512), "t.jsonl")
    first = tok.decode(examples[0]["input_ids"])
    assert first.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>2 + 3 = 5.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>5.<|return|>"
    )
    assert [tok.decode([t for t, lab in zip(e["input_ids"], e["labels"]) if lab != -100]) for e in examples] == [
        "5.<|return|>",
        "Snow.<|return|>",
    ]
    assert (st.examples, st.split_rows, st.reasoning_turns, st.reasoning_unrendered) == (2, 1, 2, 1)
    # a row that ends in a tool call: the true reason, not "cut by data.max_length"
    call_only = {"tools": [weather], "messages": row["messages"][3:5]}
    _, st = mod.tokenize_rows(
        [row, {**row, "messages": row["messages"][:5]}, call_only],
        tok,
        mod.DataConfig(max_length=512, max_dropped_fraction=1.0),
        "t.jsonl",
    )
    assert (st.call_endings, st.unanswered, st.dropped) == ([2], [3], 0)
    assert (
        "1 skipped as they end in a tool call with no answer to label (rows 3), 1 end in a tool call after their "
        "last answer, not trained (rows 2)"
    ) in st.summary()
    with pytest.raises(mod.sft.SFTDataError, match=r"1 end in a tool call with no answer to label \(rows 1\)"):
        mod.tokenize_rows([call_only], tok, mod.DataConfig(max_length=512), "t.jsonl")


def test_a_nonfinite_step_is_skipped_and_the_next_one_in_a_row_stops_the_run(tmp_path, capfd):
    """A learning rate of 1e30 turns step 1's update into weights that make step 2's gradients NaN:
    train.on_nonfinite=skip leaves step 2 out and counts it (in the train records and the checkpoint), and step 3,
    NaN again, is one more than train.max_consecutive_skips=1 in a row: the run stops, exit status 4."""
    out = tmp_path / "run"
    with pytest.raises(WorkerError) as failed:
        main_in_workers(
            "gpt-oss-lora-trl",
            f"output_dir={out}",
            "optim.lr=1e30",
            "train.on_nonfinite=skip",
            "train.max_consecutive_skips=1",
            "checkpoint.every_steps=1",
            "checkpoint.keep_last=0",
        )
    assert failed.value.exc_type == "cookbook.loop.NonFiniteError" and failed.value.exception.exit_status == 4
    ckpt = out / "checkpoints"
    assert str(failed.value.exception) == (
        f"the gradients of step 3 are not finite on every rank (the optimizer step was left out): the step was not "
        f"applied, and that makes 2 non-finite steps in a row (train.max_consecutive_skips=1), so the run stops; the "
        f"newest checkpoint, from before it, is {ckpt / 'checkpoint-2'}. Lower optim.lr or raise the warm-up, or "
        f"check the data"
    )
    assert (
        "step 2: non-finite gradients, optimizer step left out, step skipped (1 skipped so far)"
        in capfd.readouterr().err
    )
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert [(r["step"], r["skipped_steps"]) for r in train] == [(1, 0), (2, 1)]
    assert [json.loads((ckpt / f"checkpoint-{s}" / "meta.json").read_text())["skipped_steps"] for s in (1, 2)] == [0, 1]
    one, two = (load_file(ckpt / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (1, 2))
    assert one and all(torch.equal(one[k], two[k]) for k in one)  # step 2 changed no weight


def test_launch_dry_run_for_two_nodes():
    """launch.sh calls cookbook.launch, whose dry run (DRY_RUN=1) prints the check and the torchrun command."""
    python3 = Path(sys.executable).parent / "python3"
    env = {
        **os.environ,
        "PATH": f"{python3.parent}{os.pathsep}{os.environ['PATH']}",
        "DRY_RUN": "1",
        "NGPU": "8",
        "NNODES": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "CONFIG_FILE": "gpt-oss-120b.yaml",
    }
    env.pop("MASTER_PORT", None)
    out = subprocess.run(
        ["bash", str(RECIPE / "launch.sh"), "train.max_steps=3"], capture_output=True, text=True, env=env, timeout=60
    )
    config, train = RECIPE / "gpt-oss-120b.yaml", RECIPE / "train.py"
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"check: env COOKBOOK_WORLD_SIZE=16 {python3} {train} --check --config {config} train.max_steps=3",
        f"run: {python3} -m cookbook.torchrun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 "
        f"--nproc-per-node 8 --max-restarts 3 {train} --config {config} train.max_steps=3",
    ]


def test_bad_rows_are_refused(tmp_path):
    mod = load_recipe("gpt-oss-lora-trl")
    good = (TINY / "data" / "chat.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(good[:2] + ['{"messages": [{"role": "robot", "content": "hi"}]}'] + good[2:]) + "\n")
    with pytest.raises(mod.sft.SFTDataError, match=rf"^{bad} line 3: messages\[0\]\.role is 'robot', expected one of"):
        check("gpt-oss-lora-trl", f"data.train_files=[{bad}]")
    row = json.loads(good[0])
    row["messages"][-1]["thinking"] = 7
    bad.write_text("\n".join([good[1], json.dumps(row)]) + "\n")
    with pytest.raises(
        mod.sft.SFTDataError, match=rf"^{bad} line 2: field 'messages\[2\]\.thinking' must be a string, got int$"
    ):
        check("gpt-oss-lora-trl", f"data.train_files=[{bad}]")
    with pytest.raises(mod.ConfigError, match=r"model.attn_implementation"):
        check("gpt-oss-lora-trl", "model.attn_implementation=sdpa")
    with pytest.raises(mod.ConfigError, match=r"^parallel=fsdp needs CUDA GPUs: on CPU the Trainer ignores"):
        check("gpt-oss-lora-trl", "parallel=fsdp")
    cfg = mod.load_config(mod.Config, RECIPE / "gpt-oss-120b.yaml")
    assert (cfg.parallel, cfg.model.name_or_path, cfg.train.activation_checkpointing) == (
        "fsdp",
        "openai/gpt-oss-120b",
        "full",
    )


def test_fsdp_random_init_rank0_draws_every_weight_and_the_other_ranks_hold_shapes(monkeypatch):
    """parallel=fsdp with model.pretrained=false: rank 0 gets a CPU model whose every weight was drawn by
    transformers' init rules (norms ones, biases zero, weights normal(0, initializer_range), rotary tables
    recomputed), the other ranks a model on the meta device (the Trainer broadcasts rank 0's weights)."""
    import logging

    from transformers import AutoConfig, AutoModelForCausalLM

    mod = load_recipe("gpt-oss-lora-trl")
    cfg = mod.Config()
    cfg.model.pretrained = False
    hf_config = AutoConfig.from_pretrained(TINY / "gpt_oss")
    log = logging.getLogger("test")
    monkeypatch.setenv("RANK", "1")
    other = mod.load_model(cfg, hf_config, torch.float32, None, log, init_device=torch.device("cpu"))
    assert {p.device.type for p in other.parameters()} == {"meta"}
    monkeypatch.setenv("RANK", "0")
    model = mod.load_model(cfg, hf_config, torch.float32, None, log, init_device=torch.device("cpu"))
    reference = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    std = hf_config.initializer_range
    params = dict(model.named_parameters())
    assert {p.device.type for p in params.values()} == {"cpu"}
    for name, p in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("_bias") or name.endswith(".bias") and "router" not in name:
            assert torch.equal(p, torch.zeros_like(p)), name
        elif p.numel() >= 1000:
            assert abs(p.std().item() - std) < 0.1 * std, (name, p.std().item())
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, dict(reference.named_buffers())[name], msg=name)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(model(input_ids=ids).logits).all()
