"""The Qwen SFT Ray Train recipe on CPU: 2 Ray workers, tiny Qwen2 config, offline tokenizer and data."""

import pytest
from conftest import ROOT, read_jsonl, train_losses
from ray_cluster import recipe_module, run_driver_forked, run_launch, summary

RECIPE = ROOT / "recipes" / "qwen-ray-sft"


def test_stop_after_the_first_checkpoint_resume_learn_and_export(ray_env, tmp_path):
    out = tmp_path / "run"
    # The stopped run: the driver forked from pytest (no interpreter start-up); the resume goes through launch.sh.
    first = run_driver_forked("qwen-ray-sft", ray_env, f"output_dir={out}", "train.stop_at_step=8")
    assert first.returncode == 0, first.stderr[-4000:]
    assert sorted(train_losses(out / "metrics.jsonl")) == list(range(1, 9)) and not (out / "final").exists()

    second = run_launch("qwen-ray-sft", ray_env, f"output_dir={out}")
    assert second.returncode == 0, second.stderr[-4000:]
    assert "checkpoint_step_00000008 (step 8)" in second.stderr
    records = read_jsonl(out / "metrics.jsonl")
    steps = [r["step"] for r in records if r["event"] == "train"]
    assert steps == list(range(1, 17))  # the second run started at step 9
    losses = train_losses(out / "metrics.jsonl")
    assert sum(losses[s] for s in (14, 15, 16)) / 3 < 0.75 * sum(losses[s] for s in (1, 2, 3)) / 3, losses
    end = summary(records)
    assert end["reports_per_worker"] == [1, 1] and end["param_fingerprints"][0] == end["param_fingerprints"][1]
    assert end["eval/tokens"] > 0 and end["eval/loss"] < losses[1]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 2


def test_bad_input_fails_before_ray_starts(tmp_path, monkeypatch):
    train = recipe_module("qwen-ray-sft")
    base = ["--config", str(RECIPE / "tiny.yaml"), "--check", f"output_dir={tmp_path / 'out'}"]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="ray.num_workers=64"):
        train.main([*base, "ray.num_workers=64"])
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="rows.jsonl row 1: the conversation has no assistant turn"):
        train.main([*base, f"data.train_files=[{bad}]"])
    with pytest.raises(ValueError, match="model.name_or_path: folder not found: /no/such/model"):
        train.main([*base, "model.name_or_path=/no/such/model"])
    with pytest.raises(ValueError, match="model.attn_implementation=flex_attention cannot train on CPU"):
        train.main([*base, "model.attn_implementation=flex_attention"])


def tiny_config(*overrides):
    train = recipe_module("qwen-ray-sft")
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", list(overrides))
    train.check_config(cfg, RECIPE)
    return cfg


def _ddp_eval(rows: list) -> tuple:
    """The recipe's evaluate on the DDP-wrapped model (as Ray Train's prepare_model wraps it on 2 CPU workers) over
    `rows`; the model's weights from rank 0."""
    from functools import partial

    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    import cookbook
    from cookbook import sft

    train = recipe_module("qwen-ray-sft")
    info = cookbook.get_dist_info()
    cfg = tiny_config()
    torch.manual_seed(cfg.train.seed)
    inner = train.build_model(cfg.model, 100, info.device)
    batches = DataLoader(rows[info.rank::info.world_size], batch_size=cfg.train.micro_batch_size,
                         collate_fn=partial(sft.collate, pad_id=0))  # as train_loop's final evaluation
    result = sft.evaluate(DistributedDataParallel(inner), batches, info.device)
    return result, inner.state_dict() if info.rank == 0 else None


def test_eval_of_one_row_on_two_workers_equals_one_process():
    """Fewer eval rows than workers: the worker without a row runs no forward, and the value is that row's loss per
    label token computed in one process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import cookbook
    from cookbook import sft

    cfg = tiny_config()
    _, evals, _ = sft.training_rows(cfg.data, AutoTokenizer.from_pretrained(cfg.model.tokenizer), cfg.train.seed)
    result, state = cookbook.distributed(num_processes=2, start_method="fork", timeout_minutes=1)(_ddp_eval).distributed(evals[:1])[0]
    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.name_or_path)).eval()
    plain.load_state_dict(state)
    batch = sft.collate(evals[:1], pad_id=0)
    labels = (batch["labels"][:, 1:] != -100).sum()
    with torch.no_grad():
        expected = sft.token_loss_sum(plain, batch) / labels
    assert result["tokens"] == labels
    assert float(result["loss"]) == pytest.approx(float(expected), rel=1e-5)
