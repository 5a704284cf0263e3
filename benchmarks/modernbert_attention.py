"""Attention implementations for ModernBERT-base with padded batches, on one GPU.

For each of ``sdpa``, ``sdpa_padsafe`` (recipes/modernbert-ddp/train.py) and ``eager``: builds
ModernBERT-base (transformers' ModernBertConfig defaults, random init), runs forward + backward
+ fused AdamW in bf16 autocast on a batch of 64 sequences padded to 256 tokens (real lengths
drawn from 30-199), reports how many parameters received a non-finite gradient on the first
step, and the mean step time over 10 steps after 3 warm-up steps.

    python benchmarks/modernbert_attention.py
"""

import importlib.util
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForSequenceClassification, ModernBertConfig

recipe = Path(__file__).resolve().parents[1] / "recipes" / "modernbert-ddp" / "train.py"
spec = importlib.util.spec_from_file_location("modernbert_ddp_train", recipe)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
module.register_attention()  # the "sdpa_padsafe" attention

torch.manual_seed(0)
B, S = 64, 256
lengths = torch.randint(30, 200, (B,))
mask = (torch.arange(S)[None] < lengths[:, None]).long().cuda()
ids = torch.randint(5, 50000, (B, S)).cuda() * mask
labels = torch.randint(0, 4, (B,)).cuda()
print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | transformers {transformers.__version__}")
for impl in ["sdpa", "sdpa_padsafe", "eager"]:
    model = AutoModelForSequenceClassification.from_config(
        ModernBertConfig(num_labels=4, attn_implementation=impl)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)

    def step(model=model, opt=opt, check: bool = False) -> int:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        bad = (
            sum(int(not torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None) if check else 0
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        return bad

    bad = step(check=True)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / 10
    print(f"{impl:13s} params with non-finite grad: {bad} | {dt * 1000:.1f} ms/step | {B / dt:.0f} samples/s")
    del model, opt
    torch.cuda.empty_cache()
