"""Peak GPU memory of DDP training steps, fresh and after a resume, for fused and foreach AdamW.

A check behind the Qwen Ray SFT benchmark (benchmarks/README.md): a resumed run there peaked one fp32
weight copy higher than a fresh one. This script trains a causal LM built from a config (its layer
count cut to `--layers`) for 3 steps under DDP on one GPU, prints the memory allocated after every
backward and optimizer step and the peak, and saves the model and optimizer state; `resume` loads that
state the way `cookbook.ray_train.worker.load_checkpoint` does (memory-mapped on the CPU) and repeats.

    CFG=<config.json of Qwen2.5-3B>
    for fused in 1 0; do
      torchrun --standalone --nproc-per-node 1 benchmarks/resume_memory.py fresh --config $CFG --fused $fused
      torchrun --standalone --nproc-per-node 1 benchmarks/resume_memory.py resume --config $CFG --fused $fused
    done
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["fresh", "resume"])
    p.add_argument("--config", required=True, help="a model's config.json")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--fused", type=int, default=1, help="1: fused AdamW, 0: foreach")
    p.add_argument("--state", default="/tmp/resume_memory_state.pt")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args()

    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cfg = AutoConfig.from_pretrained(args.config)
    cfg.num_hidden_layers = args.layers
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-5, fused=bool(args.fused))

    def mem() -> str:
        return f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB now, {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak"

    print(
        f"{args.mode}, {'fused' if args.fused else 'foreach'} AdamW, "
        f"{sum(q.numel() for q in model.parameters()) / 1e6:.1f} M params | built: {mem()}"
    )
    if args.mode == "resume":
        state = torch.load(args.state, map_location="cpu", mmap=True, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        del state
        print(f"loaded: {mem()}")
    torch.cuda.reset_peak_memory_stats()
    for i in range(3):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ddp(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        print(f"step {i + 1} after backward: {mem()}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {i + 1} after optimizer step: {mem()}")
    if args.mode == "fresh":
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
