"""benchmarks/moe_ceiling.py on CPU with a tiny Qwen3-MoE config: one step per experts implementation."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "model_type": "qwen3_moe",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "max_position_embeddings": 64,
}


def load_script():
    spec = importlib.util.spec_from_file_location("moe_ceiling", ROOT / "benchmarks" / "moe_ceiling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moe_ceiling_cpu(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    out, prof = tmp_path / "m.jsonl", tmp_path / "prof.txt"
    moe = load_script()
    moe.main(
        [
            "--config",
            str(cfg),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--tokens",
            "32",
            "--seq-len",
            "16",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--experts",
            "grouped_mm",
            "eager",
            "--out",
            str(out),
            "--profile",
            str(prof),
        ]
    )
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["experts_implementation"] for r in recs] == ["grouped_mm", "eager"]
    d, L, E, k, f, V = 32, 2, 4, 2, 16, 128
    attn = d * (4 * 8) + 2 * d * (2 * 8) + (4 * 8) * d + 2 * 8  # q, k, v, o; q_norm and k_norm
    experts = E * (2 * f * d + f * d)
    layer = attn + d * E + experts * k / E + 2 * d  # router, active experts, 2 RMSNorms
    active = L * layer + d + V * d  # final norm, lm_head (input embeddings excluded)
    for r in recs:
        assert r["tokens_per_s"] > 0 and r["tokens_per_step"] == 32
        assert r["active_params"] == active
        assert r["flops_per_token"] == 6 * active + 12 * L * 32 * 16
        assert r["peak_alloc_gib"] is None and r["mfu_pct"] is None
    # the same weights and tokens under both implementations: the same loss, near ln(V) at random init
    assert recs[0]["loss_first"] == pytest.approx(recs[1]["loss_first"], abs=1e-4)
    assert abs(recs[0]["loss_first"] - math.log(V)) < 0.5
    table = prof.read_text()
    assert table.count("## experts_implementation=") == 2 and "| all (" in table


def test_moe_ceiling_rejects_ragged_tokens(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_script().parse_args(["--tokens", "100", "--seq-len", "16"])
    assert "--tokens (100) must be a positive multiple of --seq-len (16)" in capsys.readouterr().err
