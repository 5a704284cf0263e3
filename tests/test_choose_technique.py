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
_spec = importlib.util.spec_from_file_location("choose_technique", ROOT / "scripts" / "choose_technique.py")
ct = importlib.util.module_from_spec(_spec)
sys.modules["choose_technique"] = ct  # dataclasses look their module up there
_spec.loader.exec_module(ct)

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
    e = ct.estimate(ct.TECHNIQUES[2], m, gpus=2, seq=2048, micro_batch=4)
    assert e.technique.name == "FSDP2 + AC"
    assert e.states == 8 * 8_190_735_360
    # 8192 tokens x (2h x 36 layer inputs + 215,040 B of the layer being recomputed + 8h final norm)
    assert e.activations == 8192 * (2 * 4096 * 36 + 215_040 + 8 * 4096)
    assert e.logits == 12 * 8192 * 151_936
    assert e.working == 2 * 2 * 622_329_856 + 10 * 192_946_432
    assert e.peak == 89_326_545_408  # 83.2 GiB


def test_recommendation_flips_as_memory_shrinks():
    m = ct.model_shape(str(QWEN3_8B), meta=False)
    est = {t.name: ct.estimate(t, m, gpus=8, seq=2048, micro_batch=4) for t in ct.TECHNIQUES}
    picks = [ct.recommend(est, gib)[0] for gib in (1000, 141, 80, 30, 10)]
    assert picks == ["DDP", "FSDP2", "FSDP2 + AC", "FSDP2 + AC + CPU offload", None]
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
