"""Generate the tiny interaction file of recipes/two-tower-ray (offline CI data).

Users and items fall into latent groups; a user picks 85% of its items from its own group
(popular items more often, Zipf-like) and the rest anywhere, so a two-tower model can beat the
popularity baseline on each user's last interaction. Columns: user_id, item_id, timestamp.

    python scripts/make_tiny_interactions.py
    python scripts/make_tiny_interactions.py --users 20000 --items 4000 --per-user 20 --out /tmp/interactions.csv

The defaults write the tiny set; the options write a larger one of the same construction (a benchmark's data).
"""

import argparse
import csv
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "recipes" / "two-tower-ray" / "tiny" / "data" / "interactions.csv"


def main(
    users: int = 300, items: int = 120, groups: int = 6, per_user: int = 12, seed: int = 0, out: Path = OUT
) -> None:
    """Write ``users * per_user`` interactions (no user repeats an item) to ``out`` as CSV.

    Raises:
        ValueError: ``per_user`` exceeds the items of one group (``items // groups``).
    """
    if per_user > items // groups:
        raise ValueError(f"per_user={per_user} exceeds the {items // groups} items of a group")
    rng = np.random.default_rng(seed)
    item_group = np.arange(items) % groups
    popularity = 1.0 / (1 + rng.permutation(items)) ** 0.8
    rows = []
    for u in range(users):
        g = u % groups
        own = np.flatnonzero(item_group == g)
        p_own = popularity[own] / popularity[own].sum()
        chosen: list[int] = []
        while len(chosen) < per_user:
            i = int(rng.choice(own, p=p_own)) if rng.random() < 0.85 else int(rng.integers(items))
            if i not in chosen:
                chosen.append(i)
        rows += [(f"u{u:04d}", f"i{i:04d}", 1_700_000_000 + 60 * (u * per_user + t)) for t, i in enumerate(chosen)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["user_id", "item_id", "timestamp"])
        w.writerows(rows)
    print(f"wrote {len(rows)} interactions of {users} users and {items} items to {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=300)
    p.add_argument("--items", type=int, default=120)
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--per-user", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    main(a.users, a.items, a.groups, a.per_user, a.seed, a.out)
