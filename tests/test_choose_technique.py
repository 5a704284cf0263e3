"""scripts/choose_technique.py: hand-checked parameter counts, bytes per parameter, a peak, the
recommendation as GPU memory shrinks, and bad input. Pure arithmetic (config fields, no transformers)."""

from __future__ import annotations

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
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": False}


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
    assert m.params - m.embed_params == 7_568_405_504  # the 7,568 M of benchmarks/README.md


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
    e = ct.estimate(TECHNIQUE["FSDP2 + selective AC"], m, gpus=2, seq=2048, micro_batch=4, compiled=True,
                    loss="chunked", chunk=4096)
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
    assert e.peak == 105_276_434_944  # 98.0 GiB; 110.2 with no AC and the full loss (benchmarks/README.md)


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
    assert ct.main([str(QWEN3_8B), "--gpus", "1", "--gpu-mem-gib", "80", "--seq", "16", "--micro-batch", "1",
                    "--loss", "chunked", "--loss-chunk", "0", "--no-meta"]) == 2
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
        n: ("chunked", chunked) if n.startswith("FSDP2") else ("full", full) for n in est}
    ddp = est["DDP"]
    # 22 B x 4,022,468,096 + 8192 x (90,112 B x 36 compiled layers + 8h final norm) + 12 B x 8192 x V
    assert ddp.peak == 22 * 4_022_468_096 + tokens * (90_112 * 36 + 8 * h) + full == 130_173_096_960  # 121.2 GiB
    assert ddp.peak <= 0.9 * 141 * ct.GIB  # 126.9 GiB budget: DDP fits, so it is the simplest choice
    assert ct.recommend(est, 141) == ("DDP", "ZeRO-1")
    # --loss fused is TRL's (the ZeRO recipe): the FSDP2 rows count the full logits then
    fused = {t.name: ct.estimate(t, m, **{**kw, "loss": "fused"}) for t in ct.TECHNIQUES}
    assert fused["ZeRO-3 + AC"].logits == 0 and fused["FSDP2 + AC"].logits == fused["DDP"].logits == full
    assert ct.main([str(QWEN3_4B), "--gpus", "1", "--gpu-mem-gib", "141", "--seq", "2048", "--micro-batch", "4",
                    "--compile", "--loss", "chunked", "--no-meta"]) == 0
    out = capsys.readouterr().out
    assert ("logits, full loss (DDP, ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-1 + AC, ZeRO-2 + AC, ZeRO-3 + AC; their recipes "
            "have no chunked loss, so the full logits are counted)") in out
    assert "logits, chunked loss (FSDP2, FSDP2 + selective AC, FSDP2 + AC, FSDP2 + AC + CPU offload)" in out
    assert "\nDDP                           82.4    24.9    13.9     0.0    0.0   121.2  fits\n" in out
    assert "recommended: DDP (121.2 GiB <= 126.9; recipes/modernbert-ddp, full loss)" in out
