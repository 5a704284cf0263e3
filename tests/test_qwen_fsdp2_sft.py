"""The FSDP2 SFT recipe on CPU: 2 gloo ranks, tiny Qwen3 / Llama configs, offline tokenizer."""

import json

import pytest
import torch
from conftest import ROOT, check, launch, launch_and_kill, load_recipe, main_in_workers, read_jsonl, train_losses

import cookbook
from cookbook.checkpoint import CheckpointError
from cookbook.config import ConfigError
from cookbook import sft
from cookbook.sft import SFTDataError, tokenize_conversation

RECIPE = ROOT / "recipes" / "qwen-fsdp2-sft"


def recipe_module():
    return load_recipe("qwen-fsdp2-sft")


def tiny_config(*overrides):
    train = recipe_module()
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", list(overrides))
    train.check_config(cfg, RECIPE)
    return cfg


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted run of tiny.yaml (2 forked workers; `test_a_killed_worker_...` goes through launch.sh)."""
    out = tmp_path_factory.mktemp("fsdp-full") / "run"
    main_in_workers("qwen-fsdp2-sft", f"output_dir={out}")
    return out


def test_loss_falls(full_run):
    losses = train_losses(full_run / "metrics.jsonl")
    assert sorted(losses) == list(range(1, 31))
    first, last = sum(losses[s] for s in range(1, 4)) / 3, sum(losses[s] for s in range(28, 31)) / 3
    assert last < 0.75 * first, (first, last)


@pytest.mark.parametrize("option", ["train.loss=full", "train.activation_checkpointing=none"])
def test_full_loss_and_no_checkpointing_give_the_shipped_settings_losses(full_run, tmp_path, capfd, option):
    """tiny.yaml trains with the chunked loss (16 labelled tokens per chunk, several chunks per micro-batch) and
    selective activation checkpointing, as config.yaml does. The full fp32 logits instead, or no checkpointing,
    give the same per-step losses on 2 ranks (same schedule: the run stops at step 3 of 30)."""
    out = tmp_path / "run"
    main_in_workers("qwen-fsdp2-sft", f"output_dir={out}", option, "train.stop_at_step=3", "mlflow=false")
    assert (
        "loss full |" if option == "train.loss=full" else "AC none | loss chunked (16 tokens per chunk)"
    ) in capfd.readouterr().err
    expected, got = train_losses(full_run / "metrics.jsonl"), train_losses(out / "metrics.jsonl")
    assert sorted(got) == [1, 2, 3]
    torch.testing.assert_close(
        torch.tensor([got[s] for s in (1, 2, 3)], dtype=torch.float64),
        torch.tensor([expected[s] for s in (1, 2, 3)], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    assert got[3] < got[1]


def _shard_report():
    """Build the tiny model (random init) on this job's ranks: whether every parameter is a DTensor, the
    elements held here and in all, and the full state dict (on rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    train = recipe_module()
    info = cookbook.get_dist_info()
    model, flops = train.build_model(tiny_config(), info, vocab_size_needed=100)
    params = list(model.parameters())
    local = sum(p.to_local().numel() for p in params)
    total = sum(p.numel() for p in params)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return all(isinstance(p, DTensor) for p in params), local, total, full if info.rank == 0 else None


def test_parameters_are_dtensor_shards_and_the_random_init_does_not_depend_on_the_world_size():
    all_dtensor, local, total, on_2 = cookbook.distributed(num_processes=2, start_method="fork")(
        _shard_report
    ).distributed()[0]
    assert all_dtensor
    assert abs(local / total - 0.5) < 0.01, (local, total)  # rank 0 holds half (dim-0 shards, even sizes)
    on_1 = cookbook.distributed(num_processes=1, start_method="fork")(_shard_report).distributed()[0][3]
    assert sorted(on_2) == sorted(on_1)
    for name, tensor in on_1.items():
        torch.testing.assert_close(on_2[name], tensor, rtol=0, atol=0, msg=name)
    embed = on_1["model.embed_tokens.weight"]
    assert embed.std() > 0.01 and not torch.equal(embed[: len(embed) // 2], embed[len(embed) // 2 :])


@cookbook.distributed(num_processes=2, start_method="fork")
def _hub_model_and_eval(repo_id: str, rows: list):
    """The recipe's model from a hub id (model.pretrained=true, weights read shard by shard) and its eval loss
    over `rows`, sharded over the ranks as the recipe does it."""
    from functools import partial

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torchdata.stateful_dataloader import StatefulDataLoader

    train = recipe_module()
    info = cookbook.get_dist_info()
    cfg = tiny_config(
        f"model.name_or_path={repo_id}", "model.pretrained=true", f"model.tokenizer={RECIPE / 'tiny' / 'qwen3'}"
    )
    model, _ = train.build_model(cfg, info, vocab_size_needed=100)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    loader = StatefulDataLoader(
        train.sft.shard_for_eval(rows, info.rank, info.world_size),
        batch_size=cfg.train.micro_batch_size,
        collate_fn=partial(sft.collate, pad_id=0),
    )
    return full if info.rank == 0 else None, sft.evaluate(model, loader, info.device)


def test_hub_id_loads_from_the_cache_offline_and_eval_of_one_row_on_two_ranks_is_exact(tmp_path, monkeypatch):
    """model.name_or_path as a hub id, HF_HUB_OFFLINE=1 and HF_HUB_CACHE set: the weights come from the cached
    snapshot. One eval row on 2 ranks: the eval loss is that row's loss per label token in one process."""
    from safetensors.torch import load_file
    from test_hub import make_hub_cache, use_offline_cache
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    train = recipe_module()
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(RECIPE / "tiny" / "qwen3")).save_pretrained(
        tmp_path / "model"
    )
    snapshot = make_hub_cache(tmp_path / "hub", "cookbook-tests/tiny-qwen3", tmp_path / "model")
    use_offline_cache(monkeypatch, tmp_path / "hub")
    cfg = tiny_config()
    _, evals, _ = train.sft.load_examples(
        cfg.data, AutoTokenizer.from_pretrained(RECIPE / "tiny" / "qwen3"), cfg.train.seed
    )
    rows = train.sft.pack(evals[:1], cfg.data.max_length, pad_id=0)
    assert len(rows) == 1

    full, result = _hub_model_and_eval.distributed("cookbook-tests/tiny-qwen3", rows)[0]
    saved = load_file(snapshot / "model.safetensors")
    assert set(saved) <= set(full)
    for name, tensor in saved.items():
        torch.testing.assert_close(full[name], tensor, rtol=0, atol=0, msg=name)

    plain = AutoModelForCausalLM.from_pretrained(snapshot).eval()
    batch = sft.collate(rows, pad_id=0)
    with torch.no_grad():
        expected = sft.token_loss_sum(plain, batch) / (batch["labels"][:, 1:] != -100).sum()
    assert result["tokens"] == (batch["labels"][:, 1:] != -100).sum()
    assert float(result["loss"]) == pytest.approx(float(expected), rel=1e-5)


def test_a_killed_worker_restarts_and_the_run_ends_like_an_uninterrupted_one(full_run, tmp_path):
    """FSDP2 under a real fault: launch.sh as users run it, rank 0 SIGKILLed right after the checkpoint of step 15
    is published; the launcher restarts the group, which reloads the sharded model and optimizer (DCP) and the
    data position, and finishes with the uninterrupted run's per-step losses."""
    out = tmp_path / "run"
    proc = launch_and_kill("qwen-fsdp2-sft", f"output_dir={out}", once=out / "checkpoints" / "step_00000015", rank="0")
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    assert "restart 1 of 3: rank 0 was killed by SIGKILL" in err, err[-3000:]
    assert "resumed from" in err and "(step 15)" in err, err[-3000:]
    expected, got = train_losses(full_run / "metrics.jsonl"), train_losses(out / "metrics.jsonl")
    torch.testing.assert_close(
        torch.tensor([got[s] for s in range(1, 31)], dtype=torch.float64),
        torch.tensor([expected[s] for s in range(1, 31)], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )


@cookbook.distributed(num_processes=2, start_method="fork")
def _optimizer_after_load(checkpoint: str):
    train = recipe_module()
    from cookbook.checkpoint import ModelOptimizerState

    info = cookbook.get_dist_info()
    cfg = tiny_config()
    model, _ = train.build_model(cfg, info, vocab_size_needed=100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    import torch.distributed.checkpoint as dcp

    dcp.load({"app": ModelOptimizerState(model, optimizer)}, checkpoint_id=checkpoint)
    out = {}
    for name, p in model.named_parameters():
        st = optimizer.state[p]
        name = name.replace("_checkpoint_wrapped_module.", "")  # checkpoints use the Hugging Face names
        out[name] = {k: st[k].full_tensor() for k in ("exp_avg", "exp_avg_sq")}
    return out if info.rank == 0 else None


def test_optimizer_moments_after_load_equal_the_saved_ones(full_run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = full_run / "checkpoints" / "step_00000030"
    dcp_to_torch_save(ckpt, tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=False)["app"]["optim"]["state"]
    loaded = _optimizer_after_load.distributed(str(ckpt))[0]
    assert set(loaded) == set(saved)
    for name, moments in loaded.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(moments[key], saved[name][key], rtol=0, atol=0)
    assert any(m["exp_avg"].abs().sum() > 0 for m in loaded.values())


@cookbook.distributed(num_processes=2, start_method="fork")
def _sharded_logits(checkpoint: str, input_ids: torch.Tensor):
    train = recipe_module()
    import torch.distributed.checkpoint as dcp

    info = cookbook.get_dist_info()
    model, _ = train.build_model(tiny_config(), info, vocab_size_needed=100)
    from cookbook.checkpoint import ModelOptimizerState

    dcp.load({"app": ModelOptimizerState(model)}, checkpoint_id=checkpoint)
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits


def test_export_reloads_with_the_sharded_models_logits(full_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(full_run / "final")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 plus 4?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    sharded = _sharded_logits.distributed(str(full_run / "checkpoints" / "step_00000030"), ids)[0]
    exported = AutoModelForCausalLM.from_pretrained(full_run / "final").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, sharded, rtol=1e-5, atol=1e-5)


def test_pretrained_weights_load_shard_by_shard(full_run, tmp_path):
    """A new run from the exported safetensors (HuggingFaceStorageReader into DTensor shards) starts
    where the first run ended: with a negligible learning rate its eval loss is the first run's."""
    before = [r for r in read_jsonl(full_run / "metrics.jsonl") if r["event"] == "summary"][-1]["eval/loss"]
    out = tmp_path / "from-export"
    main_in_workers(
        "qwen-fsdp2-sft",
        f"output_dir={out}",
        f"model.name_or_path={full_run / 'final'}",
        "model.pretrained=true",
        "train.max_steps=2",
        "optim.lr=1e-12",
        "mlflow=false",
        "checkpoint.every_steps=0",
    )
    after = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "summary"][-1]["eval/loss"]
    assert after == pytest.approx(before, rel=1e-5)
    assert train_losses(out / "metrics.jsonl")[1] < train_losses(full_run / "metrics.jsonl")[1] - 1.0  # not random init


def _main(argv: list[str]) -> None:
    recipe_module().main(argv)


def test_a_2_rank_checkpoint_resumes_on_1_rank_with_the_same_global_batch(full_run, tmp_path, capfd):
    """The checkpoint of step 15 (2 ranks, 4 x 2 x 2 = 16 rows per step) resumes on 1 rank: refused by launch.sh's
    check until the global batch is kept (train.grad_accum_steps=4), then DCP reshards the FSDP2 model and AdamW
    state onto one rank and the data continues at row 240. The losses of steps 16-20 are the 2-rank run's within
    float tolerance (the same rows per step: the model, the moments and the schedule were restored)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(full_run, out, ignore=shutil.ignore_patterns("step_00000030", "final", "mlflow*"))
    with pytest.raises(CheckpointError) as err:  # launch.sh's check, before any worker starts
        check("qwen-fsdp2-sft", f"output_dir={out}", world_size=1)
    assert (
        "written with a global batch of 16 samples (4 micro-batch x 2 accumulation x 2 ranks) but this job's is "
        "8 (4 x 2 x 1)"
        in str(err.value)
        and "set train.grad_accum_steps=4 (4 x 4 x 1 = 16)" in str(err.value)
    )
    assert "NGPU x NNODES = 2" in str(err.value) and str(err.value).endswith("or start afresh with a new output_dir")
    assert "config OK" in check("qwen-fsdp2-sft", f"output_dir={out}", "train.grad_accum_steps=4", world_size=1)
    assert "config OK" in check("qwen-fsdp2-sft", f"output_dir={out}", world_size=2)
    assert "config OK" in check("qwen-fsdp2-sft", f"output_dir={tmp_path / 'new'}", world_size=1)

    capfd.readouterr()
    cookbook.distributed(num_processes=1, start_method="fork")(_main).distributed(
        [
            "--config",
            str(RECIPE / "tiny.yaml"),
            f"output_dir={out}",
            "train.grad_accum_steps=4",
            "mlflow=false",
            "train.stop_at_step=20",
        ]
    )
    err = capfd.readouterr().err
    resized = [line.split(" ", 1)[1] for line in err.splitlines() if " resized: " in line]
    assert len(resized) == 1 and resized[0].startswith(
        f"resized: {out / 'checkpoints' / 'step_00000015'} was written by 2 ranks, this job has 1. Resharded by DCP: the "
        f"model and optimizer state. Remapped: the data position, epoch 0 at sample 240 of "
    ), err[-3000:]
    assert resized[0].endswith(
        " in the same order (global batch 16 samples, as before). Not restored, as in a fresh "
        "run (seeded at start-up): the per-rank state (rank_local: dataloader, rng)"
    )
    expected, got = train_losses(full_run / "metrics.jsonl"), train_losses(out / "metrics.jsonl")
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"][30:] == list(range(16, 21))
    have = torch.tensor([got[s] for s in range(16, 21)], dtype=torch.float64)
    want = torch.tensor([expected[s] for s in range(16, 21)], dtype=torch.float64)
    torch.testing.assert_close(have, want, rtol=1e-5, atol=0)  # measured: 7e-8 at most


def test_a_finished_run_says_how_to_train_again_and_the_advice_works(full_run, tmp_path, capfd):
    import re
    import shutil

    out = tmp_path / "done"
    shutil.copytree(full_run, out)
    main_in_workers("qwen-fsdp2-sft", f"output_dir={out}")
    message = next(line for line in capfd.readouterr().err.splitlines() if "already complete" in line)
    advice = message.split("To train again, ", 1)[1]
    assert advice == f"use a new output_dir (or delete {out}).", message
    assert "config OK" in check("qwen-fsdp2-sft", f"output_dir={tmp_path / 'new'}")  # a new output_dir starts afresh
    shutil.rmtree(re.search(r"\(or delete (.+)\)\.$", advice)[1])
    assert "config OK" in check("qwen-fsdp2-sft", f"output_dir={out}")  # so does the deleted one


def test_llama_config_trains(tmp_path):
    main_in_workers(
        "qwen-fsdp2-sft",
        f"output_dir={tmp_path / 'out'}",
        "model.name_or_path=tiny/llama",
        "train.max_steps=12",
        "checkpoint.every_steps=0",
        "mlflow=false",
        "train.activation_checkpointing=full",
    )
    losses = train_losses(tmp_path / "out" / "metrics.jsonl")
    assert losses[12] < losses[1] - 0.5, losses


# The sharding options keep full_run's 30-step schedule (HSDP stops at 6; stop_at_step needs checkpoints) and its losses.
@pytest.mark.parametrize(
    "options, steps",
    [
        (("fsdp.replicate_degree=2", "train.stop_at_step=6"), 6),  # HSDP: 2 x 1
        (
            (
                "fsdp.reshard_after_forward=false",
                "train.activation_checkpointing=none",
                "train.profile_step=3",
                "checkpoint.every_steps=-1",
            ),
            30,
        ),
        (("data.packing=false", "train.max_steps=6"), 6),
    ],
)
def test_sharding_and_data_options_train(full_run, tmp_path, options, steps, capfd):
    out = tmp_path / "out"
    main_in_workers("qwen-fsdp2-sft", f"output_dir={out}", "mlflow=false", *options)
    stderr = capfd.readouterr().err
    losses = train_losses(out / "metrics.jsonl")
    assert sorted(losses) == list(range(1, steps + 1)) and losses[steps] < losses[1]
    if "fsdp.replicate_degree=2" in options:
        assert "FSDP2 mesh 2x1" in stderr
    if "data.packing=false" not in options:  # the same rows per step: replicas that never all-reduce drift from step 3
        expected = train_losses(full_run / "metrics.jsonl")
        torch.testing.assert_close(
            torch.tensor([losses[s] for s in range(1, steps + 1)], dtype=torch.float64),
            torch.tensor([expected[s] for s in range(1, steps + 1)], dtype=torch.float64),
            rtol=1e-5,
            atol=0,
        )  # float32 losses, as the resume tests compare them
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    if "checkpoint.every_steps=-1" in options:  # benchmarks: no checkpoint at all
        assert checkpoints == []
        for rank in (0, 1):  # the profiled step's operator table names the FSDP collectives
            assert "all_gather" in (out / "profile" / f"ops_rank{rank}.txt").read_text()
            assert (out / "profile" / f"trace_rank{rank}.json").stat().st_size > 1000
    else:  # the tiny config saves every 15 steps, and always at the end or at train.stop_at_step
        assert checkpoints == [f"step_{steps:08d}"]


@pytest.mark.parametrize(
    "recipe, packing",
    [(r, p) for r in ("cookbook.sft", "moe-lora-fsdp2-ep") for p in (True, False)] + [("qwen-zero3-receipts", True)],
)
def test_token_counts_are_exact_when_the_pad_token_is_the_end_of_turn_token(recipe, packing):
    """A tokenizer without a pad token (as Llama 3 Instruct's) pads with its end-of-sequence token, which also ends
    every assistant turn: the tokens/s and MFU counts of each recipe's batches still count every real token
    (cookbook.sft.collate: qwen-fsdp2-sft, qwen-ray-sft; without cu_seq_lens: qwen-zero3-receipts, moe-lora-fsdp2-ep)."""
    from transformers import AutoTokenizer

    from cookbook import lm

    tokenizer = AutoTokenizer.from_pretrained(RECIPE / "tiny" / "qwen3")
    tokenizer.pad_token = None
    pad_id = sft.pad_token_id(tokenizer)  # what the recipes use without a pad token
    assert pad_id == tokenizer.eos_token_id
    examples, _ = sft.prepare(
        sft.load_rows(RECIPE / "tiny" / "data" / "chat.jsonl")[:6], tokenizer, 64, "chat.jsonl", split_turns=True
    )  # Qwen3's template rewrites earlier turns
    assert all(pad_id in ex["input_ids"] for ex in examples)  # real tokens with the pad id
    real = sum(len(ex["input_ids"]) for ex in examples)
    rows = sft.pack(examples, 128, pad_id) if packing else examples
    if recipe != "cookbook.sft":  # qwen-zero3-receipts: its packed rows (unpacked ones come from TRL's collator)
        batch = sft.collate(rows, pad_id, cu_seq_lens=False)
    else:
        batch = sft.collate(rows, pad_id)
    assert batch["input_ids"].numel() > real  # there is padding to leave out
    assert lm.count_tokens(batch, pad_id) == real
    assert (batch["input_ids"] != pad_id).sum() < real  # what counting by token id gives


def test_varlen_attention_on_a_cpu_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="varlen runs on CUDA GPUs only"):
        check("qwen-fsdp2-sft", f"output_dir={tmp_path / 'out'}", "model.attn_implementation=varlen")


def test_flex_attention_on_a_cpu_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="flex_attention cannot train on CPU .* use sdpa"):
        check("qwen-fsdp2-sft", f"output_dir={tmp_path / 'out'}", "model.attn_implementation=flex_attention")


def test_cpu_offload_on_a_cpu_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="fsdp.cpu_offload=true needs GPUs"):
        check("qwen-fsdp2-sft", f"output_dir={tmp_path / 'out'}", "fsdp.cpu_offload=true")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.float8=true"], "train.float8=true needs train.compile=true"),
        (
            ["train.float8=true", "train.compile=true", "train.activation_checkpointing=selective"],
            "train.float8=true does not work with train.activation_checkpointing=selective",
        ),
        (
            ["train.float8=true", "train.compile=true", "train.activation_checkpointing=full"],
            "train.float8=true needs a CUDA GPU of compute capability 8.9 or newer (float8 matmuls); this run has a cpu device",
        ),
    ],
)
def test_float8_where_it_cannot_run_is_refused_by_the_check(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        check("qwen-fsdp2-sft", f"output_dir={tmp_path / 'out'}", *overrides)
    assert str(err.value).startswith(message)


def test_float8_converts_every_projection_of_a_qwen3_decoder_layer():
    """All seven linears of a Qwen3-4B decoder layer have sizes that float8 matmuls take (multiples of 16); a
    linear with 10 outputs is left alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    train = recipe_module()
    hf_config = AutoConfig.from_pretrained(ROOT / "tests" / "data" / "config_Qwen3-4B.json")
    hf_config.num_hidden_layers = 1
    with torch.device("meta"):
        layer = AutoModelForCausalLM.from_config(hf_config).model.layers[0]
    linears = {n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears == {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    }
    assert all(train.float8_module_filter(m, n) for n, m in layer.named_modules() if n in linears)
    assert not train.float8_module_filter(torch.nn.Linear(64, 10, device="meta"), "head")
    assert not train.float8_module_filter(layer.input_layernorm, "input_layernorm")


@pytest.mark.parametrize(
    "config", ["config.yaml", "qwen2.5-3b.yaml", "llama3.1-8b-2nodes.yaml", "gemma2-27b-4nodes.yaml", "fsdp-10m.yaml"]
)
def test_shipped_configs_are_valid(config):
    train = recipe_module()
    cfg = train.load_config(train.Config, RECIPE / config)
    train.check_config(cfg, RECIPE)
    assert cfg.model.name_or_path


# ----------------------------------------------------------------------------- bad input
def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_rows_fail_before_workers(tmp_path):
    bad = _jsonl(
        tmp_path / "bad.jsonl",
        [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": "no answer here"}]},
        ],
    )
    proc = launch("qwen-fsdp2-sft", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{bad}]")
    assert proc.returncode == 2 and "bad.jsonl line 2" in proc.stderr and "assistant" in proc.stderr, proc.stderr
    assert "torch/distributed/run.py" not in proc.stderr


def test_a_bad_row_is_named_by_the_first_check_on_a_used_output_dir(full_run, tmp_path):
    """The data is checked before the resume: another data file on a used output_dir (which the resume refuses,
    another setting) is named by its bad row at once, not after the resume's refusal was answered."""
    bad = _jsonl(
        tmp_path / "bad.jsonl",
        [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": "no answer here"}]},
        ],
    )
    with pytest.raises(SFTDataError, match="bad.jsonl line 2"):
        check("qwen-fsdp2-sft", f"output_dir={full_run}", f"data.train_files=[{bad}]")
    with pytest.raises(CheckpointError):  # a good file instead: the resume's refusal, as before
        check("qwen-fsdp2-sft", f"output_dir={full_run}", "train.seed=7")


def test_tokenizer_without_chat_template(tmp_path):
    import shutil

    tok_dir = tmp_path / "tok"
    shutil.copytree(RECIPE / "tiny" / "qwen3", tok_dir)
    (tok_dir / "chat_template.jinja").unlink()
    with pytest.raises(SFTDataError, match="chat template"):
        check("qwen-fsdp2-sft", f"output_dir={tmp_path / 'out'}", f"model.tokenizer={tok_dir}")


def test_tokenizer_larger_than_the_model(tmp_path):
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(RECIPE / "tiny" / "qwen3", model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["vocab_size"] = 64
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ConfigError, SFTDataError)) as err:
        check("qwen-fsdp2-sft", f"output_dir={tmp_path / 'out'}", f"model.name_or_path={model_dir}")
    assert "64" in str(err.value) and "482" in str(err.value)


def _chat(question, answer):
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def test_long_rows_are_truncated_or_dropped_and_counted(tmp_path):
    from transformers import AutoTokenizer

    long_prompt, long_answer = (
        _chat("What is 1 plus 1? " * 30, "1 plus 1 is 2."),
        _chat("What is 3 plus 3?", "6. " * 40),
    )
    data = _jsonl(
        tmp_path / "long.jsonl", [long_prompt] * 3 + [long_answer] * 2 + [_chat("What is 2 plus 2?", "4.")] * 35
    )
    tok = AutoTokenizer.from_pretrained(RECIPE / "tiny" / "qwen3")
    n = len(tokenize_conversation(tok, long_prompt["messages"], 10_000, {"enable_thinking": False})[0])
    out = check("qwen-fsdp2-sft", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{data}]", "data.max_length=64")
    assert (
        f"data: long.jsonl: 40 rows read, 37 examples kept (2 truncated to max_length=64), 3 dropped (cut by "
        f"max_length before any assistant token: line 1 ({n} tokens), line 2 ({n} tokens), line 3 ({n} tokens)) | "
    ) in out
    with pytest.raises(SFTDataError) as err:  # 3 of 40 is more than 5%
        check(
            "qwen-fsdp2-sft",
            f"output_dir={tmp_path / 'out'}",
            f"data.train_files=[{data}]",
            "data.max_length=64",
            "data.max_dropped_fraction=0.05",
        )
    assert str(err.value) == (
        f"{data}: 3 of 40 rows dropped (8%, more than data.max_dropped_fraction=0.05): 3 cut by data.max_length=64 "
        f"before any assistant token, longest line 1 ({n} tokens), line 2 ({n} tokens), line 3 ({n} tokens): raise "
        f"data.max_length (to {n} to keep them all); or raise data.max_dropped_fraction"
    )


def test_multi_turn_rows_need_split_turns_with_qwen3s_template(tmp_path):
    # tiny/qwen3 carries Qwen3's own template, which rewrites earlier assistant turns: row 5 has two.
    with pytest.raises(
        SFTDataError,
        match=r"chat\.jsonl line 5: the chat template is not prefix-stable: .*"
        r"set data\.split_turns=true",
    ):
        check("qwen-fsdp2-sft", f"output_dir={tmp_path / 'out'}", "data.split_turns=false")
    # A prefix-stable template (the ChatML of tiny/llama) takes the same rows whole.
    out = check(
        "qwen-fsdp2-sft", f"output_dir={tmp_path / 'out'}", "data.split_turns=false", "model.name_or_path=tiny/llama"
    )
    assert "data: chat.jsonl: 600 rows read, 600 examples kept" in out
