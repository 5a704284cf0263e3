"""The MoE LoRA recipe (FSDP2 + expert parallelism) on CPU: 2 gloo ranks, tiny Nemotron-H (Mamba, MoE,
attention, MoE; 4 experts, top-2) and tiny Qwen3-MoE, offline tokenizer, generated chat rows.

Every run starts from the same random weights saved to disk (``init``). Runs call the recipe's ``main`` in
2 forked workers of this process (``@cookbook.distributed``); only the resumed run goes through launch.sh,
as users run it, with a worker killed on the way. Bad input is checked in-process with the preflight that launch.sh runs.
"""

import math
import re

import pytest
import torch
from conftest import (
    ROOT,
    check,
    launch_and_kill,
    load_recipe,
    main_in_workers,
    read_jsonl,
    train_losses,
    recipe_modules,
)

import cookbook
from cookbook import sft
from cookbook.config import ConfigError

expert_parallel, moe_model = recipe_modules("moe-lora-fsdp2-ep", "expert_parallel", "moe_model")

RECIPE = ROOT / "recipes" / "moe-lora-fsdp2-ep"
STEPS = 6
# EP=2 and EP=1 do the same math in fp32; only the order of sums differs (the expert outputs of a token are
# added in another order, gradients of expert LoRA are summed over ranks in another order). Measured: losses
# equal to ~1e-7 relative, gradients to ~1e-7 absolute for values of ~1e-2. A wrong expert, a lost
# all-to-all gradient or a wrong divide factor changes them by > 1e-2.
LOSS_RTOL = 1e-5
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
COMMON = (f"train.max_steps={STEPS}", "checkpoint.every_steps=3", "mlflow=false", "data.eval_fraction=0.02")
QWEN = ("lora.target_parameters=[experts.gate_up_proj,experts.down_proj]",)


def recipe_module():
    return load_recipe("moe-lora-fsdp2-ep")


@pytest.fixture(scope="session")
def init(tmp_path_factory):
    """Random initial weights of both tiny models, saved once (model.pretrained=true loads them)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    paths = {}
    for name in ("nemotron-h", "qwen3-moe"):
        path = tmp_path_factory.mktemp("init") / name
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(RECIPE / "tiny" / name)).save_pretrained(path)
        AutoTokenizer.from_pretrained(RECIPE / "tiny" / name).save_pretrained(path)
        paths[name] = path
    return paths


@pytest.fixture(autouse=True)
def _cpu_env(monkeypatch):
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")


def run_forked(out, init, *overrides):
    """The recipe's ``main`` on 2 forked workers, as launch.sh runs it after the --check."""
    import peft  # noqa: F401  imported once here, inherited by the forked workers

    main_in_workers(
        "moe-lora-fsdp2-ep", f"output_dir={out}", f"model.name_or_path={init}", "model.pretrained=true", *overrides
    )
    return out


def tiny_config(*overrides):
    train = recipe_module()
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", list(overrides))
    train.check_config(cfg, RECIPE)
    return cfg


@cookbook.distributed(num_processes=2, start_method="fork")
def _one_step(init: str, overrides: tuple, eval_rows: list, keys: tuple) -> dict:
    """One forward/backward on the same batch with EP=2, then EP=1 (expert LoRA on the routed tokens, the
    default), then EP=2 with PEFT's expert forward (``"2-peft"``), EP=2 with the MoE blocks recomputed in
    backward, all-to-all included (``"2-ckpt"``), EP=2 with each MoE block's router and routed experts compiled
    (``"2-moe"``) and EP=1 with each decoder layer compiled (``"1-layers"``; both with the backend the test
    sets), those of `keys`; LoRA gradients of the unsharded model,
    what each rank holds, and whether an optimizer step left the base weights alone. Before that step: the
    eval loss over `eval_rows` (sharded over the ranks as the recipe does it) and, for EP=1, the full base
    weights as loaded (the LoRA factors start as the identity: B = 0)."""
    from functools import partial

    from torchdata.stateful_dataloader import StatefulDataLoader

    train = recipe_module()
    info = cookbook.get_dist_info()
    torch.manual_seed(1)
    batch = {"input_ids": torch.randint(3, 500, (2, 24)), "labels": torch.randint(3, 500, (2, 24))}
    mine = {k: v[info.rank : info.rank + 1] for k, v in batch.items()}  # each rank its own row, as in training
    result = {}
    for key in keys:
        ep, path, ckpt, compiled = {
            "2-peft": (2, "peft", "none", "none"),
            "2-ckpt": (2, "routed", "experts", "none"),
            "2-moe": (2, "routed", "none", "moe"),
            "1-layers": (1, "routed", "none", "layers"),
        }.get(key, (key, "routed", "none", "none"))
        cfg = tiny_config(
            f"model.name_or_path={init}",
            "model.pretrained=true",
            f"parallel.ep={ep}",
            f"lora.expert_lora={path}",
            f"train.activation_checkpointing={ckpt}",
            f"train.compile={compiled}",
            *overrides,
        )
        from torch._dynamo.utils import counters

        counters.clear()
        model, flops, par = train.build_model(cfg, info)
        router = moe_model.RouterStats(model)
        loss_sum = sft.token_loss_sum(model, mine)
        aux = router.take()
        (loss_sum * info.world_size / 46).backward()
        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        grads = expert_parallel.gather_lora(model, par, grads=True)
        losses = cookbook.all_reduce_sum({"loss": loss_sum}, info.device)["loss"]
        experts = next(
            p
            for n, p in model.named_parameters()
            if n.endswith("experts.base_layer.base_layer.down_proj") or n.endswith("experts.base_layer.down_proj")
        )
        lora_a = (
            next(p for n, p in model.named_parameters() if n in par.expert_lora_names and ".lora_A." in n)
            if ep > 1
            else None
        )
        eval_loader = StatefulDataLoader(
            train.sft.shard_for_eval(eval_rows, info.rank, info.world_size),
            batch_size=cfg.train.micro_batch_size,
            collate_fn=partial(sft.collate, pad_id=0),
        )
        evaluation = moe_model.evaluate(model, eval_loader, info.device, router)
        loaded = (
            {
                re.sub(r"\.base_layer\b", "", n.removeprefix("base_model.model.")): p.full_tensor()
                if hasattr(p, "full_tensor")
                else p
                for n, p in model.named_parameters()
                if not p.requires_grad
            }
            if ep == 1
            else None
        )
        local = {
            n: (p.to_local() if hasattr(p, "to_local") else p)
            for n, p in model.named_parameters()
            if not p.requires_grad
        }
        base = {n: t.detach().clone() for n, t in local.items()}
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, foreach=False)
        optimizer.step()
        changed = [n for n, t in local.items() if not torch.equal(t, base[n])]
        result[key] = {
            "loss": losses,
            "aux": float(aux),
            "grads": grads,
            "changed": changed,
            "local_experts": tuple((experts.to_local() if hasattr(experts, "to_local") else experts).shape),
            "global_experts": tuple(experts.shape),
            "experts_fsdp": hasattr(experts, "to_local"),
            "lora_a_local": tuple(lora_a.to_local().shape) if lora_a is not None else None,
            "active": flops.num_params,
            "eval": evaluation,
            "loaded": loaded,
            "graphs": graphs,
            "breaks": breaks,
        }
    return result


@pytest.mark.parametrize("model, overrides", [("nemotron-h", ()), ("qwen3-moe", QWEN)])
def test_ep2_equals_ep1_and_each_rank_holds_its_experts(init, model, overrides, tmp_path, monkeypatch):
    """Also: the model given as a hub id loads from the Hugging Face cache offline (shard by shard), and one eval row
    on 2 ranks gives that row's loss per label token computed in one process."""
    from test_hub import make_hub_cache, use_offline_cache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = recipe_module()
    monkeypatch.setattr(moe_model, "COMPILE_BACKEND", "aot_eager")  # inherited by the forked workers
    make_hub_cache(tmp_path / "hub", f"cookbook-tests/{model}", init[model])
    use_offline_cache(monkeypatch, tmp_path / "hub")
    cfg = tiny_config(f"model.name_or_path={init[model]}", *overrides)
    _, evals, _ = train.sft.load_examples(cfg.data, AutoTokenizer.from_pretrained(init[model]), cfg.train.seed)
    # compiled (Qwen3-MoE, the benchmarked architecture; Nemotron-H's compiled MoE blocks: the compiled run below)
    keys = (2, 1, "2-peft", "2-ckpt", *(("2-moe", "1-layers") if model == "qwen3-moe" else ()))
    r = _one_step.distributed(f"cookbook-tests/{model}", overrides, evals[:1], keys)[0]
    ep2, ep1 = r[2], r[1]
    torch.testing.assert_close(ep2["loss"], ep1["loss"], rtol=LOSS_RTOL, atol=0)
    for other in keys[2:]:  # PEFT's expert forward; the MoE blocks recomputed; compiled: the same loss and gradients
        torch.testing.assert_close(r[other]["loss"], ep1["loss"], rtol=LOSS_RTOL, atol=0)
        assert set(r[other]["grads"]) == set(ep1["grads"])
        for name in ep1["grads"]:
            torch.testing.assert_close(r[other]["grads"][name], ep1["grads"][name], **GRAD_TOL, msg=f"{other} {name}")
    if "2-moe" in r:  # compiled: graphs made (not a silent eager run); the MoE blocks' without a graph break (the
        # layers' break at the FSDP2 hooks of the experts module, which dynamo leaves eager)
        assert r["2-moe"]["graphs"] > 0 and r["1-layers"]["graphs"] > 0 and r["2-moe"]["breaks"] == {}, r["2-moe"][
            "breaks"
        ]
    assert ep1["graphs"] == 0
    assert ep2["aux"] > 0.5  # Switch aux loss is ~1 at balance
    assert set(ep2["grads"]) == set(ep1["grads"]) and any("experts" in n for n in ep1["grads"])
    for name in ep1["grads"]:
        torch.testing.assert_close(ep2["grads"][name], ep1["grads"][name], **GRAD_TOL, msg=name)
    assert all(g.abs().sum() > 0 for n, g in ep1["grads"].items() if "lora_B" in n)  # B starts at 0: A's grads are 0
    # 4 experts of 32 x 64: EP=2 keeps 2 per rank (dp=1 shard: all of them); EP=1 shards the 4 over 2 ranks.
    assert ep2["global_experts"][0] == 2 and ep2["local_experts"][0] == 2
    assert ep1["global_experts"][0] == 4 and ep1["local_experts"][0] == 2
    # dp = 1 at EP=2: the frozen expert weights stay out of FSDP2 (used in place, expert_parallel.frozen_if_unsharded)
    assert not ep2["experts_fsdp"] and ep1["experts_fsdp"]
    assert ep2["lora_a_local"][0] == 2 * 4  # 2 local experts x rank 4
    assert ep2["changed"] == [] and ep1["changed"] == []  # frozen base weights do not move
    assert ep2["active"] == ep1["active"]

    plain = AutoModelForCausalLM.from_pretrained(init[model]).eval()
    for name, tensor in plain.named_parameters():
        torch.testing.assert_close(ep1["loaded"][name], tensor.detach(), rtol=0, atol=0, msg=name)
    batch = sft.collate(evals[:1], pad_id=0)
    with torch.no_grad():
        expected = sft.token_loss_sum(plain, batch) / (batch["labels"][:, 1:] != -100).sum()
    for result in (ep2, ep1):
        assert result["eval"]["tokens"] == (batch["labels"][:, 1:] != -100).sum()
        assert float(result["eval"]["loss"]) == pytest.approx(float(expected), rel=1e-5)


@cookbook.distributed(num_processes=1, start_method="fork")
def _one_rank(init: str, out: str) -> dict:
    """On a world of one: the model with FSDP2 (``parallel.fsdp_one_rank=true``) and without (the default), each
    layer compiled; one forward/backward on one batch; then the recipe's ``main`` for 3 steps without FSDP2 (`out`/a),
    and 2 with FSDP2 resumed without it to step 3 (`out`/b)."""
    from torch._dynamo.utils import counters

    train = recipe_module()
    info = cookbook.get_dist_info()
    torch.manual_seed(1)
    batch = {"input_ids": torch.randint(3, 500, (2, 24)), "labels": torch.randint(3, 500, (2, 24))}
    result = {}
    for fsdp in (True, False):
        cfg = tiny_config(
            f"model.name_or_path={init}", "model.pretrained=true", "train.compile=layers", "parallel.ep=1", *QWEN,
            f"parallel.fsdp_one_rank={str(fsdp).lower()}",
        )  # fmt: skip
        torch._dynamo.reset()
        counters.clear()
        model, _, meshes = train.build_model(cfg, info)
        loss = sft.token_loss_sum(model, batch)
        loss.backward()
        result[fsdp] = {
            "loss": loss.detach(),
            "grads": expert_parallel.gather_lora(model, meshes, grads=True),
            "dtensors": sum(hasattr(p, "to_local") for p in model.parameters()),
            "breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"],
        }
    common = ["--config", str(RECIPE / "tiny.yaml"), f"model.name_or_path={init}", "model.pretrained=true",
              "train.max_steps=3", "mlflow=false", "data.eval_fraction=0.02", "parallel.ep=1", *QWEN]  # fmt: skip
    train.main([*common, f"output_dir={out}/a"])
    train.main([*common, f"output_dir={out}/b", "parallel.fsdp_one_rank=true", "train.stop_at_step=2"])
    train.main([*common, f"output_dir={out}/b"])
    return result


def test_one_rank_runs_without_fsdp2_and_equals_the_fsdp2_step(tmp_path, monkeypatch):
    """``parallel.fsdp_one_rank=false`` on a world of one skips ``fully_shard`` (nothing to shard): plain parameters,
    each compiled layer one graph (FSDP2's hooks break it) and one compiled code for all 5 layers (2 graphs: the
    first layer's input needs no gradient), the loss and LoRA gradients of the FSDP2 model, and the loop runs; a
    checkpoint written with FSDP2 resumes without it (``parallel.fsdp_one_rank`` may change) and each step's loss
    equals the run without FSDP2's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(moe_model, "COMPILE_BACKEND", "aot_eager")
    config = AutoConfig.from_pretrained(RECIPE / "tiny" / "qwen3-moe")
    config.num_hidden_layers = 5  # more layers than one: a per-layer guard would compile each anew
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "init")
    AutoTokenizer.from_pretrained(RECIPE / "tiny" / "qwen3-moe").save_pretrained(tmp_path / "init")
    r = _one_rank.distributed(str(tmp_path / "init"), str(tmp_path / "out"))[0]
    sharded, plain = r[True], r[False]
    assert sharded["dtensors"] > 0 and plain["dtensors"] == 0
    assert sharded["breaks"] > 0 and plain["breaks"] == 0 and plain["graphs"] == 2
    torch.testing.assert_close(plain["loss"], sharded["loss"], rtol=LOSS_RTOL, atol=0)
    assert set(plain["grads"]) == set(sharded["grads"]) and any("experts" in n for n in plain["grads"])
    for name in plain["grads"]:
        torch.testing.assert_close(plain["grads"][name], sharded["grads"][name], **GRAD_TOL, msg=name)
    losses, resumed = (train_losses(tmp_path / "out" / run / "metrics.jsonl") for run in "ab")
    assert sorted(losses) == [1, 2, 3] and all(map(math.isfinite, losses.values()))
    steps = [r["step"] for r in read_jsonl(tmp_path / "out" / "b" / "metrics.jsonl") if r["event"] == "train"]
    assert steps == [1, 2, 3]  # step 3 after the resume, steps 1-2 not run again
    torch.testing.assert_close(resumed, losses, rtol=LOSS_RTOL, atol=0)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, init):
    """EP=1 uninterrupted; EP=2 stopped at step 3 (forked), then resumed to the end through launch.sh, which
    saves step 4 (``checkpoint.every_steps=4``: the checkpoint cadence may change on a resume), has rank 1 (the
    holder of experts 2 and 3) SIGKILLed right after that checkpoint is published, restarts the group and ends."""
    import os

    os.environ["COOKBOOK_DEVICE"] = "cpu"
    base = tmp_path_factory.mktemp("moe")
    ep1 = run_forked(base / "ep1", init["nemotron-h"], *COMMON, "parallel.ep=1")
    ep2 = run_forked(base / "ep2", init["nemotron-h"], *COMMON, "train.stop_at_step=3")
    second = launch_and_kill(
        "moe-lora-fsdp2-ep",
        f"output_dir={ep2}",
        f"model.name_or_path={init['nemotron-h']}",
        "model.pretrained=true",
        *COMMON,
        "checkpoint.every_steps=4",
        once=ep2 / "checkpoints" / "step_00000004",
        rank="1",
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    return ep1, ep2, second


def test_resumed_ep2_run_has_the_losses_of_an_uninterrupted_ep1_run(runs):
    ep1, ep2, second = runs
    assert f"resumed from {ep2 / 'checkpoints' / 'step_00000003'} (step 3)" in second.stderr, second.stderr[-3000:]
    a, b = train_losses(ep1 / "metrics.jsonl"), train_losses(ep2 / "metrics.jsonl")
    assert sorted(b) == list(range(1, STEPS + 1))
    torch.testing.assert_close(
        torch.tensor([b[s] for s in range(1, STEPS + 1)], dtype=torch.float64),
        torch.tensor([a[s] for s in range(1, STEPS + 1)], dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )
    assert b[STEPS] < b[1] - 0.2, b


def test_a_compiled_ep2_run_has_the_losses_of_the_eager_ep1_run(runs, init, tmp_path, monkeypatch):
    """``train.compile=moe`` at EP=2 (each MoE block's router and routed experts compiled; backend aot_eager, which
    traces forward and backward as inductor does but runs eager's kernels: in one process its loss and gradients
    equal eager's to the last bit, test_moe_routed_lora) logs every step's loss of the eager EP=1 run within the
    EP=2-against-EP=1 tolerance. The tokens each rank's experts receive change from step to step, so the
    compiled experts see new shapes (dynamic after the first recompile)."""
    monkeypatch.setattr(moe_model, "COMPILE_BACKEND", "aot_eager")  # inherited by the forked workers
    steps = 4  # of the eager run's 6 (constant learning rate: the same first steps)
    out = run_forked(
        tmp_path / "compiled",
        init["nemotron-h"],
        *COMMON,
        "train.compile=moe",
        f"train.max_steps={steps}",
        "checkpoint.every_steps=-1",
        "checkpoint.export_adapter=false",
    )
    a, b = train_losses(runs[0] / "metrics.jsonl"), train_losses(out / "metrics.jsonl")
    assert sorted(b) == list(range(1, steps + 1))
    torch.testing.assert_close(
        torch.tensor([b[s] for s in range(1, steps + 1)], dtype=torch.float64),
        torch.tensor([a[s] for s in range(1, steps + 1)], dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )
    assert b[steps] < b[1] - 0.1, b


def test_a_killed_worker_restarts_and_the_run_ends_like_an_uninterrupted_one(runs):
    """EP under a real fault (the launch of `runs`): the launcher restarts the group once, which reloads each rank's
    experts' LoRA weights and optimizer state (DCP) and the data position from step 4's checkpoint, written by the
    group it replaces; the run ends with the uninterrupted EP=1 run's per-step losses (the resume test above) and
    LoRA weights. EP=2 and EP=1 add in another order, and AdamW's normalisation amplifies it: measured 2.3e-6 at
    most, on values up to 0.2; one AdamW step moves a weight by up to lr = 1e-2."""
    from safetensors.torch import load_file

    ep1, ep2, second = runs
    err = second.stderr
    restart = err.index("restart 1 of 3: rank 1 was killed by SIGKILL; the workers resume from the newest checkpoint")
    assert "restart 2 of 3" not in err, err[-3000:]
    assert f"resumed from {ep2 / 'checkpoints' / 'step_00000004'} (step 4)" in err[restart:], err[-3000:]
    assert re.findall(r"step (\d+)/6 \| loss", err[restart:]) == ["5", "6"]  # no step lost or taken twice
    adapter, uninterrupted = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (ep2, ep1))
    assert set(adapter) == set(uninterrupted) and any("experts" in n for n in adapter)
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(adapter[name], tensor, rtol=0, atol=2e-5, msg=name)


def test_metrics_have_moe_load_balance_and_throughput(runs):
    from conftest import read_jsonl

    rec = [r for r in read_jsonl(runs[1] / "metrics.jsonl") if r["event"] == "train"][-1]
    assert (
        rec["moe/aux_loss"] > 0.5
        and rec["moe/load_max_over_mean"] >= 1.0
        and rec["moe/ep_rank_load_max_over_mean"] >= 1.0
    )
    assert rec["tokens_per_s_per_device"] > 0 and rec["rss_gib"] > 0
    names = sorted(p.name for p in (runs[1] / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000006"], names


@cookbook.distributed(num_processes=2, start_method="fork")
def _trained_logits(init: str, checkpoint: str, ids: torch.Tensor):
    import torch.distributed.checkpoint as dcp

    train = recipe_module()
    info = cookbook.get_dist_info()
    model, _, par = train.build_model(tiny_config(f"model.name_or_path={init}", "model.pretrained=true"), info)
    dcp.load({"app": expert_parallel.AdapterState(model, None, par)}, checkpoint_id=checkpoint)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def readme_snippet() -> str:
    """The Python block of the README's "Checkpoints and export" section, as written."""
    text = (RECIPE / "README.md").read_text().split("## Checkpoints and export", 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_exported_adapter_loads_with_peft_onto_the_plain_model(runs, init, tmp_path, monkeypatch):
    """PeftModel onto the plain model, and the README's snippet run as written from a folder where its
    output_dir is this run's (the base model comes from the adapter's config), give the sharded model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = runs[1]
    ids = torch.arange(3, 40).unsqueeze(0)
    sharded = _trained_logits.distributed(str(init["nemotron-h"]), str(out / "checkpoints" / "step_00000006"), ids)[0]
    base = AutoModelForCausalLM.from_pretrained(init["nemotron-h"]).eval()
    with torch.no_grad():
        before = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, out / "adapter").eval()(input_ids=ids).logits
    torch.testing.assert_close(adapted, sharded, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(adapted, before, atol=1e-3)

    snippet = readme_snippet()
    adapter_path = re.search(r'"([^"]+)/adapter"', snippet)[1]
    (tmp_path / adapter_path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / adapter_path).symlink_to(out)
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(snippet, scope)
    with torch.no_grad():
        torch.testing.assert_close(scope["merged"].eval()(input_ids=ids).logits, sharded, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- bad input (in-process --check)
@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (("parallel.ep=3",), 3, "parallel.ep=3 does not divide the 4 experts"),
        (("parallel.ep=2",), 3, "parallel.ep=2 does not divide the world size 3"),
        (
            ("lora.target_modules=[q_proj,qkv_proj]",),
            2,
            "lora.target_modules: 'qkv_proj' matches nothing in nemotron_h",
        ),
        (QWEN, 2, "lora.target_parameters: 'experts.gate_up_proj' matches nothing in nemotron_h"),
        (("model.name_or_path=tiny/dense-qwen3", "lora.target_parameters=[]"), 2, "parallel.ep=2 but"),
        (("data.packing=true",), 2, "data.packing=true with nemotron_h"),
        (("train.compile=true",), 2, "train.compile must be one of"),
        (("train.compile=moe", "lora.expert_lora=peft"), 2, "train.compile=moe compiles the routed expert LoRA"),
        (
            ("train.compile=layers", "train.activation_checkpointing=full"),
            2,
            "train.compile=layers with train.activation_checkpointing=full",
        ),
        (
            ("model.attn_implementation=flex_attention",),
            2,
            "model.attn_implementation=flex_attention cannot train on CPU",
        ),
    ],
)
def test_bad_input_is_refused_before_training(tmp_path, overrides, world_size, message):
    if "model.name_or_path=tiny/dense-qwen3" in overrides:
        import json

        dense = tmp_path / "dense-qwen3"
        dense.mkdir()
        config = json.loads((RECIPE / "tiny" / "qwen3-moe" / "config.json").read_text())
        config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
        (dense / "config.json").write_text(json.dumps(config))
        overrides = (f"model.name_or_path={dense}", f"model.tokenizer={RECIPE / 'tiny' / 'qwen3-moe'}", *overrides[1:])
    with pytest.raises(ConfigError, match=re.escape(message)):
        check("moe-lora-fsdp2-ep", f"output_dir={tmp_path / 'out'}", *overrides, world_size=world_size)


@pytest.mark.parametrize("config", ["config.yaml", "qwen3-30b-a3b.yaml", "tiny.yaml"])
def test_shipped_configs_are_valid(config):
    train = recipe_module()
    cfg = train.load_config(train.Config, RECIPE / config)
    train.check_config(cfg, RECIPE)
    if config != "tiny.yaml":  # hub models: check EP and LoRA targets on the architecture shipped in models/
        from transformers import AutoConfig, AutoModelForCausalLM

        folder = {"config.yaml": "nemotron-3-nano-30b-a3b", "qwen3-30b-a3b.yaml": "qwen3-30b-a3b"}[config]
        moe_model.check_model(
            cfg, AutoConfig.from_pretrained(RECIPE / "models" / folder), AutoModelForCausalLM, world_size=8
        )


# ----------------------------------------------------------------------------- router statistics without padding
def _router_outputs(model, router, batches):
    """The aux loss and expert loads that `router` gives for the forwards of `batches` taken as one batch: each
    MoE layer's router records (logits, chosen experts) of every forward concatenated, then `RouterStats.take`."""
    records = []
    for batch in batches:
        with torch.no_grad():
            sft.token_loss_sum(model, batch)
        records.append([getattr(block.gate, router.ATTR) for _, block in router.blocks])
        router.drop()
    for (_, block), layer in zip(router.blocks, zip(*records)):
        setattr(block.gate, router.ATTR, tuple(torch.cat(parts) for parts in zip(*layer)))
    aux = router.take()
    loads = router.loads.clone()
    router.loads.zero_()
    return aux, loads


@pytest.mark.parametrize("model, packed", [("qwen3-moe", False), ("qwen3-moe", True), ("nemotron-h", False)])
def test_router_stats_and_aux_loss_leave_padding_out(model, packed):
    """A right-padded batch, or packed rows ending in padding, gives with `moe_model.token_mask` the aux loss and expert
    loads of its documents run alone without padding; counting the padding changes both. The model in float64:
    the real tokens' router records are equal to the last bit (Nemotron-H's router casts to fp32 alike), so the loads
    must be equal; `RouterStats.take` sums in fp32, measured equal to the last bit too, and 1e-6 (a few fp32 ulps of
    ~1) allows another summation order. Counting the padding moved the aux loss by 5e-3 to 1e-2."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(RECIPE / "tiny" / model)
    config._experts_implementation = "eager"  # transformers' grouped_mm experts take no float64
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(config).double().eval()
    router = moe_model.RouterStats(net)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (13, 29, 7)]
    rows = [{"input_ids": d, "labels": [-100] + d[1:]} for d in docs]
    batch = sft.collate(sft.pack(rows, 48, pad_id=0) if packed else rows, pad_id=0, cu_seq_lens=False)
    mask = moe_model.token_mask(batch, pad_id=0)
    assert mask.shape == batch["input_ids"].shape and int(mask.sum()) == 49 < mask.numel()
    expected = _router_outputs(net, router, [{k: torch.tensor([v]) for k, v in r.items()} for r in rows])  # no padding
    with torch.no_grad():
        sft.token_loss_sum(net, batch)
    aux = router.take(mask)
    torch.testing.assert_close(aux, expected[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(router.loads, expected[1], rtol=0, atol=0)
    router.loads.zero_()
    with torch.no_grad():
        sft.token_loss_sum(net, batch)
    assert abs(float(router.take()) - float(expected[0])) > 1e-4 and router.loads.sum() > expected[1].sum()
