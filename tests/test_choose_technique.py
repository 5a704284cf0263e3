"""scripts/choose_technique.py: hand-checked parameter counts, bytes per parameter, a peak, the
recommendation as GPU memory shrinks, bad input, and the LoRA rows (--lora) with gpt_oss's MoE.
Pure arithmetic (config fields), except the gpt_oss counts checked against a meta-device model."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = ROOT / "tests" / "data" / "config_Qwen3-8B.json"
QWEN3_4B = ROOT / "tests" / "data" / "config_Qwen3-4B.json"  # the 1-GPU benchmark of benchmarks/fsdp2_sft.sh
_spec = importlib.util.spec_from_file_location("choose_technique", ROOT / "scripts" / "choose_technique.py")
ct = importlib.util.module_from_spec(_spec)
sys.modules["choose_technique"] = ct  # dataclasses look their module up there
_spec.loader.exec_module(ct)

TECHNIQUE = {t.name: t for t in ct.TECHNIQUES}
LORA_ROW = {t.name: t for t in ct.LORA_TECHNIQUES}
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
# gpt_oss: GptOssConfig().to_dict() (120B: 36 layers, 128 experts) and the 20B architecture benchmarks/gpt_oss_lora.sh
# builds (GptOssConfig(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, layer_types=[...] * 12))
GPT_OSS_20B = ROOT / "tests" / "data" / "config_gpt-oss-20b-arch.json"
GPT_OSS_120B = ROOT / "tests" / "data" / "config_gpt-oss-120b-arch.json"
TINY_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 1000,
    "attention_bias": True,
    "tie_word_embeddings": False,
}
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
}


@pytest.fixture
def tiny_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def test_parameter_count_tiny(tiny_path):
    m = ct.model_shape(str(tiny_path), meta=False)
    # layer: q 64x64 + k,v 2 x 64x32 + o 64x64 + gated MLP 3 x 64x128 + 2 norms x 64
    assert m.layer_params == 4096 + 4096 + 4096 + 24576 + 128 == 36992
    assert m.params == 1000 * 64 * 2 + 2 * 36992 + 64 == 202048  # embedding + untied head + layers + final norm
    assert (m.q_dim, m.kv_dim, m.qk_norm) == (64, 32, False)
    # tied head: one embedding fewer; folder holding config.json works too
    tiny_path.write_text(json.dumps({**TINY, "tie_word_embeddings": True}))
    assert ct.model_shape(str(tiny_path.parent), meta=False).params == 202048 - 64000


def test_parameter_count_qwen3_8b():
    m = ct.model_shape(str(QWEN3_8B), meta=False)
    # per layer: 4096^2 (q) + 2 x 4096x1024 (k, v) + 4096^2 (o) + 3 x 4096x12288 + 2 x 4096 + 2 x 128 (q/k norms)
    assert m.layer_params == 192_946_432
    assert m.params == 8_190_735_360  # 36 layers + 2 x 151936 x 4096 + 4096
    assert m.params - m.embed_params == 7_568_405_504  # the 7,568 M of benchmarks/qwen-fsdp2-sft.md


def test_bytes_per_parameter():
    by = {t.name: ct.bytes_per_param(t, 4)[0] for t in ct.TECHNIQUES}
    assert by["DDP"] == 22  # 4 + 4 + 4 buckets + 8 AdamW + 2 autocast cache
    assert by["ZeRO-1"] == 2 + 2 + 12 / 4 == 7
    assert by["ZeRO-2"] == 2 + 14 / 4 == 5.5
    assert by["ZeRO-3"] == by["FSDP2"] == by["FSDP2 + AC"] == 16 / 4 == 4
    assert by["FSDP2 + AC + CPU offload"] == 0


def test_activations_per_token_layer(tiny_path):
    m = ct.model_shape(str(tiny_path), meta=False)
    # 16h norms + 4q + 4kv attention + 8f gated MLP; compiled: 8h + 4q + 4kv + 4f
    assert sum(ct.activation_bytes_per_token_layer(m).values()) == 16 * 64 + 4 * 64 + 4 * 32 + 8 * 128 == 2432
    assert sum(ct.activation_bytes_per_token_layer(m, compiled=True).values()) == 8 * 64 + 4 * 64 + 4 * 32 + 4 * 128


def test_peak_fsdp2_ac_qwen3_8b():
    m = ct.model_shape(str(QWEN3_8B), meta=False)
    e = ct.estimate(TECHNIQUE["FSDP2 + AC"], m, gpus=2, seq=2048, micro_batch=4)
    assert e.states == 8 * 8_190_735_360
    # 8192 tokens x (2h x 36 layer inputs + 215,040 B of the layer being recomputed + 8h final norm)
    assert e.activations == 8192 * (2 * 4096 * 36 + 215_040 + 8 * 4096)
    assert e.logits == 12 * 8192 * 151_936
    assert e.working == 2 * 2 * 622_329_856 + 10 * 192_946_432
    assert e.peak == 89_326_545_408  # 83.2 GiB


def test_peak_fsdp2_selective_ac_chunked_loss_qwen3_8b():
    """config.yaml's settings (selective AC, chunked loss of 4096 tokens, per-layer compile), 2 GPUs, 4 x 2048."""
    m = ct.model_shape(str(QWEN3_8B), meta=False)
    h, q, kv, f, vocab, tokens = 4096, 4096, 1024, 12288, 151_936, 8192
    # kept per layer: input 2h + q/k/v 2q + 4kv + attention 2q + o_proj 2h + gate/up 4f + down 2h
    assert sum(ct.selective_bytes_per_token_layer(m).values()) == 6 * h + 4 * q + 4 * kv + 4 * f == 94_208
    compiled = 8 * h + (2 * q + 2 * kv) + (4 * q + 4 * kv) + 4 * f  # the layer being recomputed
    assert sum(ct.activation_bytes_per_token_layer(m, compiled=True).values()) == compiled == 112_640
    e = ct.estimate(
        TECHNIQUE["FSDP2 + selective AC"], m, gpus=2, seq=2048, micro_batch=4, compiled=True, loss="chunked", chunk=4096
    )
    assert e.states == 8 * 8_190_735_360 == 65_525_882_880
    # 8192 x (94,208 x 36 + 112,640 + 8h final norm) = 8192 x 3,536,896
    assert e.activations == tokens * (94_208 * 36 + 112_640 + 8 * h) == 28_974_252_032
    # one chunk of fp32 logits (8 B) 4,978,638,848 + head gradient (2 B x V x h) 1,244,659,712
    # + labelled hidden states and their gradient (4 B x 8192 x h) 134,217,728 = 6,357,516,288 (5.9 GiB)
    assert e.logits == 8 * 4096 * vocab + 2 * vocab * h + 4 * tokens * h == 6_357_516_288
    assert e.logits < ct.logits_bytes(m, tokens, "full")[0] / 2 == 7_467_958_272  # 12 B x 8192 x V = 13.9 GiB, halved
    assert ct.logits_bytes(m, tokens, "fused")[0] == 0  # TRL / Liger: no logits kept
    assert ct.logits_bytes(m, 1000, "chunked", chunk=4096)[0] == 8 * 1000 * vocab + 2 * vocab * h + 4 * 1000 * h
    assert e.working == 2 * 2 * 622_329_856 + 10 * 192_946_432 == 4_418_783_744
    # 65,525,882,880 + 28,974,252,032 + 6,357,516,288 + 4,418,783,744
    assert e.peak == 105_276_434_944  # 98.0 GiB; 110.2 with no AC and the full loss (benchmarks/memory-estimates.md)


def test_qwen3_4b_fits_one_141_gib_gpu_and_qwen3_8b_does_not():
    """The 1-GPU benchmark's choice: the largest Qwen3 whose AdamW states fit one H200 with the shipped settings."""
    m4, m8 = (ct.model_shape(str(p), meta=False) for p in (QWEN3_4B, QWEN3_8B))
    assert (m4.params, m4.head_params) == (4_022_468_096, 0)  # tied embeddings: no separate head
    budget = 0.9 * 141 * ct.GIB
    kw = dict(gpus=1, seq=2048, micro_batch=4, compiled=True, loss="chunked", chunk=4096)
    assert ct.estimate(TECHNIQUE["FSDP2 + selective AC"], m4, **kw).peak < budget  # 88.4 GiB
    assert ct.estimate(TECHNIQUE["FSDP2 + selective AC"], m8, **kw).peak > budget  # 159.1 GiB: states alone 122.1
    assert ct.estimate(TECHNIQUE["FSDP2 + AC"], m8, **kw).peak > budget


def test_recommendation_flips_as_memory_shrinks():
    m = ct.model_shape(str(QWEN3_8B), meta=False)
    est = {t.name: ct.estimate(t, m, gpus=8, seq=2048, micro_batch=4) for t in ct.TECHNIQUES}
    picks = [ct.recommend(est, gib)[0] for gib in (1000, 141, 80, 60, 30, 10)]
    # peaks (GiB): FSDP2 92.6, selective AC 61.0, AC 37.4, offload 22.2 against budgets of 0.9 x memory
    assert picks == ["DDP", "FSDP2", "FSDP2 + selective AC", "FSDP2 + AC", "FSDP2 + AC + CPU offload", None]
    assert ct.recommend(est, 80)[1] == "ZeRO-1 + AC"


def test_bad_input(tiny_path, capsys):
    with pytest.raises(ct.ChooserError, match="no such config file"):
        ct.load_config(str(tiny_path.parent / "missing.json"))
    tiny_path.write_text("{not json")
    with pytest.raises(ct.ChooserError, match="not a JSON config"):
        ct.load_config(str(tiny_path))
    m = ct.shape_from_fields(TINY)
    with pytest.raises(ct.ChooserError, match="positive number of GPUs"):
        ct.estimate(ct.TECHNIQUES[0], m, gpus=0, seq=16, micro_batch=1)
    assert ct.main([str(QWEN3_8B), "--gpus", "-1", "--gpu-mem-gib", "80", "--seq", "16", "--micro-batch", "1"]) == 2
    assert "positive number of GPUs" in capsys.readouterr().err
    assert (
        ct.main(
            [
                str(QWEN3_8B),
                "--gpus",
                "1",
                "--gpu-mem-gib",
                "80",
                "--seq",
                "16",
                "--micro-batch",
                "1",
                "--loss",
                "chunked",
                "--loss-chunk",
                "0",
                "--no-meta",
            ]
        )
        == 2
    )
    assert "--loss-chunk must be a positive number of tokens, got 0" in capsys.readouterr().err


def test_chunked_loss_only_where_the_recipe_has_it(capsys):
    """--loss chunked is the FSDP2 recipe's train.loss=chunked: the DDP and ZeRO rows keep the full logits,
    and the output says so. Qwen3-4B on one 141 GiB GPU (the 1-GPU benchmark's settings) still picks DDP."""
    m = ct.model_shape(str(QWEN3_4B), meta=False)
    kw = dict(gpus=1, seq=2048, micro_batch=4, compiled=True, loss="chunked", chunk=4096)
    tokens, vocab, h = 8192, 151_936, 2560
    full, chunked = 12 * tokens * vocab, 8 * 4096 * vocab + 2 * vocab * h + 4 * tokens * h
    est = {t.name: ct.estimate(t, m, **kw) for t in ct.TECHNIQUES}
    assert {n: (e.loss, e.logits) for n, e in est.items()} == {
        n: ("chunked", chunked) if n.startswith("FSDP2") else ("full", full) for n in est
    }
    ddp = est["DDP"]
    # 22 B x 4,022,468,096 + 8192 x (90,112 B x 36 compiled layers + 8h final norm) + 12 B x 8192 x V
    assert ddp.peak == 22 * 4_022_468_096 + tokens * (90_112 * 36 + 8 * h) + full == 130_173_096_960  # 121.2 GiB
    assert ddp.peak <= 0.9 * 141 * ct.GIB  # 126.9 GiB budget: DDP fits, so it is the simplest choice
    assert ct.recommend(est, 141) == ("DDP", "ZeRO-1")
    # --loss fused is TRL's (the ZeRO recipe): the FSDP2 rows count the full logits then
    fused = {t.name: ct.estimate(t, m, **{**kw, "loss": "fused"}) for t in ct.TECHNIQUES}
    assert fused["ZeRO-3 + AC"].logits == 0 and fused["FSDP2 + AC"].logits == fused["DDP"].logits == full
    assert (
        ct.main(
            [
                str(QWEN3_4B),
                "--gpus",
                "1",
                "--gpu-mem-gib",
                "141",
                "--seq",
                "2048",
                "--micro-batch",
                "4",
                "--compile",
                "--loss",
                "chunked",
                "--no-meta",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "logits, full loss (DDP, ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-1 + AC, ZeRO-2 + AC, ZeRO-3 + AC; their recipes "
        "have no chunked loss, so the full logits are counted)"
    ) in out
    assert "logits, chunked loss (FSDP2, FSDP2 + selective AC, FSDP2 + AC, FSDP2 + AC + CPU offload)" in out
    assert "\nDDP                           82.4    24.9    13.9     0.0    0.0   121.2  fits\n" in out
    # a decoder is pointed at the DDP SFT recipe, never the encoder classifier's
    assert "recommended: DDP (121.2 GiB <= 126.9; recipes/qwen-ray-sft, full loss)" in out
    assert ct.TECHNIQUES[0].recipe_for(dataclasses.replace(m, lm_head=False)) == "recipes/modernbert-ddp"


def test_parameter_count_gpt_oss_moe():
    """gpt_oss from its config fields: 20.91 B (20B architecture) and 116.83 B (120B), equal to the meta-device model."""
    m20, m120 = (ct.model_shape(str(p), meta=False) for p in (GPT_OSS_20B, GPT_OSS_120B))
    h, q, kv, f = 2880, 4096, 512, 2880
    # per layer: attention h·q + 2h·kv + q·h + biases (q + 2kv + h) + 64 sinks; router 32·h + 32; experts
    # 32 x (h·2f + f·h) + biases 32 x (2f + h); 2 norms 2h
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv + h) + 64
    assert m20.layer_params == attention + 32 * h + 32 + 32 * 3 * h * f + 32 * (2 * f + h) + 2 * h == 823_186_976
    assert (
        m20.params == 2 * 201_088 * h + 24 * 823_186_976 + h == 20_914_757_184
    )  # + embedding, untied head, final norm
    assert m120.layer_params == attention + 128 * h + 128 + 128 * 3 * h * f + 128 * (2 * f + h) + 2 * h == 3_213_080_192
    assert m120.params == 2 * 201_088 * h + 36 * 3_213_080_192 + h == 116_829_156_672
    assert (m20.experts, m20.top_k, m20.ffn, m20.heads, m20.sinks) == (32, 4, 2880, 64, True)
    meta20, meta120 = (ct.model_shape(str(p)) for p in (GPT_OSS_20B, GPT_OSS_120B))  # transformers on the meta device
    assert meta20.counted_by == "meta device (GptOssForCausalLM)"
    assert (meta20.params, meta20.layer_params, meta20.experts, meta20.top_k, meta20.sinks) == (
        20_914_757_184,
        823_186_976,
        32,
        4,
        True,
    )
    assert (meta120.params, meta120.layer_params, meta120.experts) == (116_829_156_672, 3_213_080_192, 128)


def test_lora_rows_tiny_moe():
    """The LoRA rows by hand on a tiny gpt_oss: h=64, q=64 (4 heads x 16), kv=32, 4 experts of f=32, 2 per token, V=1000."""
    m = ct.shape_from_fields(TINY_OSS)
    # layer: attention 4096 + 2 x 2048 + 4096 + biases 64 + 2 x 32 + 64 + 4 sinks; router 4 x 64 + 4;
    # experts 4 x 3 x 64 x 32 + biases 4 x (2 x 32 + 64); norms 2 x 64
    assert m.layer_params == 12_288 + 192 + 4 + 260 + 24_576 + 512 + 128 == 37_960
    assert m.params == 2 * 1000 * 64 + 2 * 37_960 + 64 == 203_984
    lora = ct.LoraSpec(4, QKVO)
    assert lora.layer_params(m) == 4 * (64 + 64) + 2 * 4 * (64 + 32) + 4 * (64 + 64) == 1792  # r·(in + out) per target
    assert lora.params(m) == 3584
    # per token per layer, fp32 adapters (DDP): norms 8h 512; LoRA inputs q, k, v 3 x 2h + o 2q + 4 x 2r = 544;
    # attention 4q + 4kv + 4 x heads = 400; sinks 16 x heads = 64; MoE k x (12f + 2h + 36) = 2 x 548 = 1096
    ddp_layer = 512 + 544 + 400 + 64 + 1096
    assert sum(ct.lora_activation_bytes_per_token_layer(m, lora).values()) == ddp_layer == 2616
    fsdp_layer = ddp_layer - 2 * 2 * 64  # bf16 adapters under FSDP2: q, k and v share one copy of their input
    assert sum(ct.lora_activation_bytes_per_token_layer(m, lora, bf16_adapters=True).values()) == fsdp_layer == 2360
    tokens = 32  # seq 16 x micro-batch 2
    kw = dict(seq=16, micro_batch=2, loss="fused", lora=lora)
    ddp = ct.estimate(LORA_ROW["LoRA DDP"], m, gpus=2, **kw)
    assert ddp.states == 2 * 203_984 + 22 * 3584 == 486_816  # bf16 base + 22 B per adapter parameter
    assert ddp.activations == tokens * (2616 * 2 + 4 * 64) == 175_616  # 2 layers + final norm's fp32 input
    assert (ddp.logits, ddp.working, ddp.step) == (0, 0, 0)
    assert ddp.peak == 662_432
    ac = ct.estimate(LORA_ROW["LoRA DDP + AC"], m, gpus=2, **kw)
    assert ac.activations == tokens * (2 * 64 * 2 + 2616 + 4 * 64) == 100_096  # layer inputs + one layer recomputed
    assert ac.peak == 486_816 + 100_096 == 586_912
    fsdp = ct.estimate(LORA_ROW["LoRA FSDP2 + AC"], m, gpus=2, **kw)
    assert fsdp.states == (2 * 203_984 + 16 * 3584) / 2 == 232_656
    # output head kept gathered 2 x 64,000 + 2 gathered layers 2 x 2 x 37,960 + one layer's adapter grads 6 x 1792
    assert fsdp.working == 128_000 + 151_840 + 10_752 == 290_592
    assert fsdp.activations == tokens * (2 * 64 * 2 + 2360 + 4 * 64) == 91_904
    assert fsdp.peak == 232_656 + 290_592 + 91_904 == 615_152
    one = ct.estimate(
        LORA_ROW["LoRA FSDP2 + AC"], m, gpus=1, **kw
    )  # 1 GPU: no all-gather, one layer unsharded at a time
    assert one.working == 128_000 + 75_920 + 10_752 and one.peak == 465_312 + 214_672 + 91_904 == 771_888
    full = ct.estimate(LORA_ROW["LoRA DDP"], m, gpus=2, **{**kw, "loss": "full"})
    assert full.logits == 12 * tokens * 1000 and full.peak == 662_432 + 384_000
    with pytest.raises(ct.ChooserError, match="needs the adapters"):
        ct.estimate(LORA_ROW["LoRA DDP"], m, gpus=1, seq=16, micro_batch=1)
    with pytest.raises(ct.ChooserError, match="mixture-of-experts"):
        ct.LoraSpec(4, ("q_proj", "down_proj")).layer_params(m)
    with pytest.raises(ct.ChooserError, match="known: q_proj"):
        ct.LoraSpec(4, ("qkv",)).layer_params(m)


def test_lora_gpt_oss_20b_against_h200_peaks():
    """The LoRA rows for the measured 1-H200 runs (benchmarks/results/gpt-oss-20b-lora-h200-2026-12-0*.jsonl: r 16 on
    q/k/v/o, 4,096-token sequences, TRL's fused LM head), each within 2% of torch.cuda.max_memory_allocated."""
    m, lora = ct.model_shape(str(GPT_OSS_20B), meta=False), ct.LoraSpec(16, QKVO)
    assert lora.params(m) == 7_962_624  # the 7.96 M trainable the recipe logs
    measured = [
        ("LoRA DDP", 1, 60.58),
        ("LoRA DDP + AC", 1, 41.03),
        ("LoRA DDP", 2, 82.04),
        ("LoRA FSDP2 + AC", 1, 42.5),
    ]
    peaks = [
        ct.estimate(LORA_ROW[n], m, gpus=1, seq=4096, micro_batch=mb, loss="fused", lora=lora).peak / ct.GIB
        for n, mb, _ in measured
    ]
    assert [round(p, 1) for p in peaks] == [60.2, 40.6, 81.3, 43.1]
    assert all(abs(p / gib - 1) < 0.02 for p, (_, _, gib) in zip(peaks, measured))
    # with the full fp32 logits (12 B x 4,096 x 201,088 = 9.2 GiB) the AC run would be 49.8 GiB, not the 41.0 measured
    full = ct.estimate(LORA_ROW["LoRA DDP + AC"], m, gpus=1, seq=4096, micro_batch=1, loss="full", lora=lora)
    assert round(full.peak / ct.GIB, 1) == 49.8


def test_lora_gpt_oss_120b_fsdp2_planned_settings(capsys):
    """gpt-oss-120b.yaml: FSDP2 + full AC, micro-batch 2 x 2,048; 139 GiB H200s with 10% headroom (125.1 GiB)."""
    m, lora = ct.model_shape(str(GPT_OSS_120B), meta=False), ct.LoraSpec(16, QKVO)
    peaks = {
        n: ct.estimate(LORA_ROW["LoRA FSDP2 + AC"], m, gpus=n, seq=2048, micro_batch=2, loss="fused", lora=lora)
        for n in (2, 4, 8)
    }
    # states (2 B x 116,829,156,672 + 16 B x 11,943,936) / N; head 2 B x 579,133,440 + 2 layers 2 x 2 B x 3,213,080,192
    # + 6 B x 331,776; 4,096 tokens x (2h x 36 + 218,256 + 4h)
    assert peaks[2].states == (2 * 116_829_156_672 + 16 * 11_943_936) / 2
    assert peaks[2].working == 2 * 579_133_440 + 4 * 3_213_080_192 + 6 * 331_776
    assert peaks[2].activations == 4096 * (2 * 2880 * 36 + 218_256 + 4 * 2880)
    assert {n: round(e.peak / ct.GIB, 1) for n, e in peaks.items()} == {2: 123.6, 4: 69.2, 8: 41.9}
    assert ct.recommend({"LoRA FSDP2 + AC": peaks[2]}, 139) == ("LoRA FSDP2 + AC", None)  # 123.6 <= 125.1
    assert (
        ct.main(
            [
                str(QWEN3_8B),
                "--gpus",
                "2",
                "--gpu-mem-gib",
                "139",
                "--seq",
                "2048",
                "--micro-batch",
                "2",
                "--lora",
                "--no-meta",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "LoRA r=16 on q_proj, k_proj, v_proj, o_proj: 15,335,424 adapter parameters" in out
    )  # 36 x 16 x (2 x 8192 + 2 x 5120)
    assert "fused loss where the recipe has it (recipes/gpt-oss-lora-trl)" in out
    assert (
        ct.main(
            [
                str(QWEN3_8B),
                "--gpus",
                "1",
                "--gpu-mem-gib",
                "80",
                "--seq",
                "16",
                "--micro-batch",
                "1",
                "--lora",
                "--lora-r",
                "0",
                "--no-meta",
            ]
        )
        == 2
    )
    assert "--lora-r must be a positive rank, got 0" in capsys.readouterr().err
