"""A shrunken copy of a model's config.json for a CPU dry run of a benchmark: the published config with the sizes
(layers, experts, widths, heads, vision blocks) of a tiny twin of the same model type, but the published
vocabulary size, token ids and context length, so that the real tokenizer (and its image token ids) fits.

    python benchmarks/tiny_config.py recipes/moe-lora-fsdp2-ep/models/nemotron-3-nano-30b-a3b/config.json \\
        recipes/moe-lora-fsdp2-ep/tiny/nemotron-h/config.json out/config.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEPT = ("vocab_size", "max_position_embeddings")  # and every "*_token_id": the published config's values stay


def shrink(full: dict, twin: dict) -> dict:
    """`full` with every value of `twin` but `KEPT` and the token ids; nested sections (``text_config``,
    ``vision_config``, ``rope_scaling``) merged key by key the same way."""
    out = dict(full)
    for key, value in twin.items():
        if key in KEPT or key.endswith("_token_id"):
            continue
        out[key] = shrink(full[key], value) if isinstance(value, dict) and isinstance(full.get(key), dict) else value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("full", type=Path, help="the published config.json")
    parser.add_argument("twin", type=Path, help="a tiny config.json of the same model type")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    full, twin = json.loads(args.full.read_text()), json.loads(args.twin.read_text())
    if full.get("model_type") != twin.get("model_type"):
        raise SystemExit(f"{args.twin}: model_type {twin.get('model_type')!r}, not {full.get('model_type')!r}")
    config = shrink(full, twin)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
