"""The image + text variant of the MoE LoRA recipe (moe-lora-fsdp2-ep, tiny-vl.yaml) on (tiny Qwen3-VL-MoE: 2 layers, 4 experts, top-2; 2 vision
blocks) with image + text rows, and shard-by-shard loading of pretrained checkpoints (``model.lazy_load``), on
CPU with 2 gloo ranks.

One launch of 2 forked workers (``_worker``) does all the distributed work, to keep the test short: EP=2 against
EP=1 on one image + text batch; lazy against full loading for the VL model and both text MoE models; the
recipe's ``main`` (training, adapter and merged export); the trained sharded model's logits. Bad input is
checked in-process with the preflight that launch.sh runs.
"""

import json
import os
import re
import traceback

import pytest
import torch
from conftest import ROOT, check, free_ports, load_recipe, read_jsonl, train_losses, recipe_modules

from cookbook import sft
from cookbook.sft import SFTDataError

expert_parallel, moe_model, image_text = recipe_modules(
    "moe-lora-fsdp2-ep", "expert_parallel", "moe_model", "image_text"
)
VLDataset, collate_vl, load_vl_items, load_vl_processors = (
    image_text.VLDataset,
    image_text.collate_vl,
    image_text.load_vl_items,
    image_text.load_vl_processors,
)

RECIPE = TEXT_RECIPE = (
    ROOT / "recipes" / "moe-lora-fsdp2-ep"
)  # TEXT_RECIPE: its tiny text models (shard-by-shard loading)
TINY_VL = RECIPE / "tiny" / "qwen3-vl-moe"
STEPS = 6
# As in test_moe_lora_ep.py: EP=2 and EP=1 differ only in the order of sums (measured ~1e-7).
LOSS_RTOL = 1e-5
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Random weights of the three tiny models, saved in several safetensors files each (shard-by-shard loading
    has files to walk). The VL model's experts are written in the hub layout of Qwen3-VL-MoE, (E, in, out),
    which transformers transposes at load time."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    base = tmp_path_factory.mktemp("ckpt")
    paths = {}
    for name, auto in (
        ("qwen3-vl-moe", AutoModelForImageTextToText),
        ("qwen3-moe", AutoModelForCausalLM),
        ("nemotron-h", AutoModelForCausalLM),
    ):
        torch.manual_seed(0)
        tiny = RECIPE / "tiny" / name
        auto.from_config(AutoConfig.from_pretrained(tiny)).save_pretrained(base / name, max_shard_size="100KB")
        paths[name] = base / name
    files = sorted(paths["qwen3-vl-moe"].glob("*.safetensors"))
    assert len(files) > 3
    for f in files:
        tensors = load_file(f)
        if any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in tensors):
            save_file(
                {
                    k: v.transpose(1, 2).contiguous()
                    if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
                    else v
                    for k, v in tensors.items()
                },
                f,
                metadata={"format": "pt"},
            )
    return paths


def vl_overrides(init, *more):
    return (f"model.name_or_path={init}", f"model.tokenizer={TINY_VL}", "model.pretrained=true", *more)


def vl_config(*overrides):
    train = load_recipe("moe-lora-fsdp2-ep")
    cfg = train.load_config(train.VLConfig, RECIPE / "tiny-vl.yaml", list(overrides))
    train.check_config(cfg, RECIPE)
    return cfg


def image_batch(cfg, rows: slice) -> dict:
    """Rows of tiny/data/vl.jsonl through the recipe's own data path (tokenize, expand image tokens, patches)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    tokenizer, image_processor = load_vl_processors(
        cfg.model.tokenizer, cfg.data.image_min_pixels, cfg.data.image_max_pixels
    )
    items, _ = load_vl_items(cfg.data, cfg.train.seed)
    dataset = VLDataset(
        items[rows],
        tokenizer=tokenizer,
        image_processor=image_processor,
        image_token_id=hf_config.image_token_id,
        max_length=cfg.data.max_length,
    )
    return collate_vl([dataset[i] for i in range(len(dataset))], tokenizer.pad_token_id, hf_config.image_token_id)


def local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _worker(checkpoints: dict, out: str, ports: list[int]) -> dict:
    """All the distributed work of this file, on every rank (see the module docstring)."""
    import cookbook

    train = text = load_recipe("moe-lora-fsdp2-ep")
    os.environ["MASTER_PORT"] = str(ports[0])
    info = cookbook.init_distributed()
    result = {"ep": {}, "lazy": {}}

    # EP=2 and EP=1 on the same image + text batch: each rank its own 2 rows.
    cfg = vl_config(*vl_overrides(checkpoints["qwen3-vl-moe"]))
    mine = image_batch(cfg, slice(2 * info.rank, 2 * info.rank + 2))
    tokens = cookbook.all_reduce_sum({"t": (mine["labels"][:, 1:] != -100).sum()}, info.device)["t"]
    for ep in (2, 1):
        model, _, par = train.build_model(
            vl_config(*vl_overrides(checkpoints["qwen3-vl-moe"]), f"parallel.ep={ep}"), info
        )
        router = moe_model.RouterStats(model)
        loss_sum = sft.token_loss_sum(model, mine)
        aux = router.take()
        (loss_sum * info.world_size / tokens).backward()
        frozen = {n: local(p) for n, p in model.named_parameters() if not p.requires_grad}
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, foreach=False).step()
        experts = next(p for n, p in model.named_parameters() if n.endswith("experts.base_layer.base_layer.down_proj"))
        vision = [p for n, p in model.named_parameters() if ".visual.blocks." in n]
        result["ep"][ep] = {
            "loss": cookbook.all_reduce_sum({"l": loss_sum}, info.device)["l"],
            "aux": float(aux),
            "grads": expert_parallel.gather_lora(model, par, grads=True),
            "changed": [
                n for n, p in model.named_parameters() if not p.requires_grad and not torch.equal(local(p), frozen[n])
            ],
            "experts": (
                tuple(experts.shape),
                tuple((experts.to_local() if hasattr(experts, "to_local") else experts).shape),
            ),
            "vision_sharded_frozen": all(hasattr(p, "to_local") and not p.requires_grad for p in vision)
            and len(vision) > 0,
        }

    # Shard-by-shard loading (default) against transformers' from_pretrained of the whole model, EP=2 (the text
    # models through the text recipe's build_model).
    text_overrides = {
        "qwen3-moe": ("lora.target_parameters=[experts.gate_up_proj,experts.down_proj]",),
        "nemotron-h": (),
    }
    for name, path in checkpoints.items():
        states = []
        for lazy in ("true", "false"):
            overrides = [f"model.name_or_path={path}", "model.pretrained=true", f"model.lazy_load={lazy}"]
            if name == "qwen3-vl-moe":
                c = vl_config(*vl_overrides(path), f"model.lazy_load={lazy}")
            else:
                c = text.load_config(text.Config, TEXT_RECIPE / "tiny.yaml", overrides + list(text_overrides[name]))
                text.check_config(c, TEXT_RECIPE)
            model, _, _ = train.build_model(c, info)
            states.append(
                {
                    **{n: local(p) for n, p in model.named_parameters()},
                    **{n: b.clone() for n, b in model.named_buffers()},
                }
            )
        lazy_state, full_state = states
        result["lazy"][name] = {
            "names": sorted(lazy_state) == sorted(full_state),
            "max_diff": max((lazy_state[n].float() - full_state[n].float()).abs().max().item() for n in full_state),
            "experts_local": [
                tuple(t.shape)
                for n, t in lazy_state.items()
                if n.endswith(("experts.base_layer.base_layer.down_proj", "experts.base_layer.down_proj"))
            ][:1],
        }
    cookbook.destroy_distributed()

    # The recipe's main: train, export the adapter and the merged model.
    os.environ["MASTER_PORT"] = str(ports[1])
    train.main(
        [
            "--config",
            str(RECIPE / "tiny-vl.yaml"),
            *vl_overrides(checkpoints["qwen3-vl-moe"]),
            f"output_dir={out}",
            f"train.max_steps={STEPS}",
            "checkpoint.every_steps=0",
            "checkpoint.export_merged=true",
        ]
    )

    # The trained sharded model's logits on one image + text batch (the same on both ranks).
    import torch.distributed.checkpoint as dcp

    os.environ["MASTER_PORT"] = str(ports[2])
    info = cookbook.init_distributed()
    model, _, par = train.build_model(vl_config(*vl_overrides(checkpoints["qwen3-vl-moe"])), info)
    dcp.load(
        {"app": expert_parallel.AdapterState(model, None, par)}, checkpoint_id=f"{out}/checkpoints/step_{STEPS:08d}"
    )
    batch = {k: v for k, v in image_batch(cfg, slice(0, 2)).items() if k != "labels"}
    model.eval()
    with torch.no_grad():
        result["logits"] = model(**batch, use_cache=False).logits
    result["batch"] = batch
    cookbook.destroy_distributed()
    return result


def _entry(rank: int, fn, args: tuple, out_dir: str) -> None:
    torch.set_num_threads(1)  # one thread per rank, as torchrun; a forked pool can also hang
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", COOKBOOK_DEVICE="cpu"
    )
    code = 0
    try:
        torch.save(fn(*args), f"{out_dir}/result{rank}.pt")
    except BaseException:
        with open(f"{out_dir}/error{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        code = 1
    os._exit(code)  # not the parent's (pytest's) exit handlers


def run_2_workers(fn, *args, out_dir, timeout=600):
    """``fn(*args)`` on 2 processes forked from this one (the recipe and its libraries are imported once, here);
    each rank's return value, or an AssertionError holding the first failed rank's traceback."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_entry, args=(rank, fn, args, str(out_dir))) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            for q in procs:
                q.kill()
    errors = [(out_dir / f"error{r}.txt").read_text() for r in range(2) if (out_dir / f"error{r}.txt").exists()]
    assert not errors and all(p.exitcode == 0 for p in procs), (
        f"exit codes {[p.exitcode for p in procs]}\n" + "\n".join(errors)
    )
    return [torch.load(out_dir / f"result{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    import peft  # noqa: F401  imported once here, inherited by the forked workers

    base = tmp_path_factory.mktemp("vlm")
    load_recipe("moe-lora-fsdp2-ep")
    results = run_2_workers(_worker, checkpoints, str(base / "out"), free_ports(3), out_dir=base)
    return results, base / "out"


def test_vl_ep2_equals_ep1_on_an_image_text_batch(runs):
    ep2, ep1 = runs[0][0]["ep"][2], runs[0][0]["ep"][1]
    torch.testing.assert_close(ep2["loss"], ep1["loss"], rtol=LOSS_RTOL, atol=0)
    assert 0 < float(ep1["loss"]) and ep2["aux"] > 0.5
    assert (
        set(ep2["grads"]) == set(ep1["grads"]) and sum("experts" in n for n in ep1["grads"]) == 8
    )  # 2 layers x 2 weights x A, B
    assert not any(".visual." in n for n in ep1["grads"])  # the vision tower has no LoRA
    for name in ep1["grads"]:
        torch.testing.assert_close(ep2["grads"][name], ep1["grads"][name], **GRAD_TOL, msg=name)
    assert all(g.abs().sum() > 0 for n, g in ep1["grads"].items() if "lora_B" in n)
    # 4 experts of (64, 48): EP=2 keeps 2 per rank; EP=1 shards the 4 over 2 ranks (FSDP2, dim 0).
    assert ep2["experts"] == ((2, 64, 48), (2, 64, 48)) and ep1["experts"] == ((4, 64, 48), (2, 64, 48))
    assert ep2["changed"] == [] and ep1["changed"] == []  # frozen base weights (vision tower included) do not move
    assert ep2["vision_sharded_frozen"] and ep1["vision_sharded_frozen"]


def test_lazy_loading_gives_the_weights_of_a_full_load(runs):
    for rank, result in enumerate(runs[0]):
        assert set(result["lazy"]) == {"qwen3-vl-moe", "qwen3-moe", "nemotron-h"}
        for name, r in result["lazy"].items():
            assert r["names"], (rank, name)
            assert r["max_diff"] == 0.0, (rank, name, r["max_diff"])  # the same bytes, LoRA factors included
            assert r["experts_local"][0][0] == 2, (rank, name, r)  # 2 of the 4 experts on each rank


def test_vl_training_loss_falls_and_exports_load_with_peft_and_transformers(runs, checkpoints):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    results, out = runs
    losses = train_losses(out / "metrics.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1] - 0.2, losses
    assert [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "eval"], "the held-out rows were evaluated"
    batch, sharded = results[0]["batch"], results[0]["logits"]
    torch.testing.assert_close(results[1]["logits"], sharded)
    base = AutoModelForImageTextToText.from_pretrained(checkpoints["qwen3-vl-moe"]).eval()
    with torch.no_grad():
        before = base(**batch).logits
        adapted = PeftModel.from_pretrained(base, out / "adapter").eval()(**batch).logits
        merged = AutoModelForImageTextToText.from_pretrained(out / "merged").eval()(**batch).logits
    torch.testing.assert_close(adapted, sharded, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(adapted, before, atol=1e-3)
    assert (out / "merged" / "preprocessor_config.json").is_file() and (out / "merged" / "tokenizer.json").is_file()


# ----------------------------------------------------------------------------- bad input (in-process --check)
@pytest.mark.parametrize(
    "row, message",
    [
        (
            {
                "image": "insects/missing.jpg",
                "messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}],
            },
            "bad.jsonl line 2: image file not found: {data}/insects/missing.jpg",
        ),
        (
            {
                "image": "broken.jpg",
                "messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}],
            },
            "bad.jsonl line 2: cannot decode image {data}/broken.jpg",
        ),
        (
            {"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]},
            "bad.jsonl line 2: no image",
        ),
        (
            {
                "images": ["insects/ant0.jpg"],
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "image"}]},
                    {"role": "assistant", "content": "A."},
                ],
            },
            "bad.jsonl line 2: 1 image(s) but 2 {'type': 'image'} part(s)",
        ),
    ],
)
def test_bad_image_text_rows_are_refused_before_training(tmp_path, row, message):
    data = tmp_path / "data"
    (data / "insects").mkdir(parents=True)
    (data / "insects" / "ant0.jpg").write_bytes((RECIPE / "tiny" / "data" / "insects" / "ant0.jpg").read_bytes())
    (data / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a JPEG")
    good = json.loads((RECIPE / "tiny" / "data" / "vl.jsonl").read_text().splitlines()[0])
    good["image"] = "insects/ant0.jpg"
    (data / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(SFTDataError, match=re.escape(message.replace("{data}", str(data)))):
        check(
            "moe-lora-fsdp2-ep",
            f"output_dir={tmp_path / 'out'}",
            f"data.train_files=[{data / 'bad.jsonl'}]",
            config="tiny-vl.yaml",
        )


def test_vl_configs_are_valid_and_packing_is_refused(tmp_path):
    from cookbook.config import ConfigError

    out = check("moe-lora-fsdp2-ep", f"output_dir={tmp_path / 'out'}", config="tiny-vl.yaml")
    assert "18 train / 2 eval image + text rows; 20 rows with 24 images checked" in out
    with pytest.raises(ConfigError, match="data.packing=true with qwen3_vl_moe"):
        check("moe-lora-fsdp2-ep", f"output_dir={tmp_path / 'out'}", "data.packing=true", config="tiny-vl.yaml")
    from transformers import AutoConfig, AutoModelForImageTextToText

    train = load_recipe("moe-lora-fsdp2-ep")
    cfg = train.load_config(train.VLConfig, RECIPE / "qwen3-vl-30b-a3b.yaml")
    train.check_config(cfg, RECIPE)
    moe_model.check_model(
        cfg,
        AutoConfig.from_pretrained(RECIPE / "models" / "qwen3-vl-30b-a3b"),
        AutoModelForImageTextToText,
        world_size=8,
    )
