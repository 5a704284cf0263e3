"""Compare two Hugging Face export folders of the same architecture: tensor names, shapes and dtypes, and that each
reloads with `AutoModelForCausalLM.from_pretrained` with no missing or unexpected keys. Used to check that a
setting which changes the modules during training (``train.float8=true`` in recipes/qwen-fsdp2-sft swaps the
decoder's linears for torchao's Float8Linear) exports what the plain run exports.

    python benchmarks/compare_exports.py outputs/bf16/final outputs/float8/final

Prints one JSON line (``same``: true when names, shapes and dtypes all agree and both reload cleanly) and exits
1 when they do not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def tensors(folder: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) of every tensor in the folder's ``*.safetensors`` files, read from their headers."""
    from safetensors import safe_open

    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sliced = f.get_slice(name)
                found[name] = (list(sliced.get_shape()), sliced.get_dtype())
    if not found:
        raise SystemExit(f"{folder}: no *.safetensors files")
    return found


def reload_report(folder: Path) -> dict:
    """Load the folder into CPU memory; what transformers reports missing, unexpected or mismatched (empty: clean)."""
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    return {k: sorted(v) if isinstance(v, (set, list)) else str(v) for k, v in info.items() if v}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    a, b = tensors(args.a), tensors(args.b)
    differ = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
    loads = {str(args.a): reload_report(args.a), str(args.b): reload_report(args.b)}
    same = not differ and not any(loads.values())
    print(
        json.dumps(
            {
                "same": same,
                "tensors": len(a),
                "dtypes": sorted({d for _, d in a.values()}),
                "differ": [[n, a.get(n), b.get(n)] for n in differ[:20]],
                "loading_info": loads,
            }
        )
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
