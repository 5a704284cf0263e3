"""Generate the tiny Criteo-format file of recipes/torchrec-dlrm (offline CI data).

Same format as the Criteo display-advertising logs (Kaggle DAC ``train.txt``): tab-separated label,
13 integer features (I1-I13, counts; some missing, some negative as in the real I2) and 26 categorical
features (C1-C26, 8-hex-digit hashes; some missing). Each categorical feature draws from its own
Zipf-like vocabulary; the click probability depends on a few of them and on two counts, so the model
can learn more than the base rate (about 25% clicks, as in Criteo).

    python scripts/make_tiny_criteo.py
"""

from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "recipes" / "torchrec-dlrm" / "tiny" / "data" / "train.txt"


def main(rows: int = 3072, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    vocab_sizes = rng.integers(3, 400, size=26)
    vocabs = [[f"{v:08x}" for v in rng.integers(0, 2**32, size=n)] for n in vocab_sizes]
    effects = [rng.normal(0, 1.2 if j < 6 else 0.2, size=n) for j, n in enumerate(vocab_sizes)]
    lines = []
    for _ in range(rows):
        counts = rng.poisson(rng.uniform(0.5, 40, size=13)).astype(int)
        counts[1] -= rng.integers(0, 3)  # I2 has small negative values in the real data
        picks = [min(int(rng.zipf(1.3)) - 1, n - 1) for n in vocab_sizes]
        logit = (
            -1.6
            + 0.6 * np.log1p(max(counts[0], 0))
            - 0.4 * np.log1p(counts[4])
            + sum(effects[j][picks[j]] for j in range(26))
        )
        label = int(rng.random() < 1 / (1 + np.exp(-logit)))
        dense = ["" if rng.random() < 0.15 else str(c) for c in counts]
        cats = ["" if rng.random() < 0.08 else vocabs[j][picks[j]] for j in range(26)]
        lines.append("\t".join([str(label), *dense, *cats]))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {rows} rows to {OUT} ({sum(l.startswith('1') for l in lines) / rows:.0%} clicks)")


if __name__ == "__main__":
    main()
