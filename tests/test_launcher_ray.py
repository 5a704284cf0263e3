"""``cookbook.distributed(backend="ray")`` on the session's Ray head (``ray_env``): every rank's result, in rank
order. Apart from test_launcher.py so that only the Ray modules share the Ray tests' worker (tests/conftest.py
puts every module that uses ``ray_env`` in one xdist group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


RAY_SCRIPT = textwrap.dedent("""
    import json
    import ray, torch, cookbook

    @cookbook.distributed(num_processes=2, backend="ray")
    def ranks(x: int):
        info = cookbook.get_dist_info()
        t = torch.tensor([float(info.rank)])
        torch.distributed.all_reduce(t)
        return {"rank": info.rank, "world": info.world_size, "sum": t.item(), "x": x}

    if __name__ == "__main__":
        out = ranks.distributed(7)
        print(json.dumps({"out": out, "left": not ray.is_initialized()}), flush=True)
""")


def test_ray_backend_returns_every_rank_in_order(ray_env, tmp_path):
    # In a child interpreter: a test process that joined Ray must not fork later (the Ray recipe tests fork).
    script = tmp_path / "ray_ranks.py"
    script.write_text(RAY_SCRIPT)
    env = {**os.environ, **{k: v for k, v in ray_env.items() if not k.startswith("_")}}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["out"] == [{"rank": 0, "world": 2, "sum": 1.0, "x": 7}, {"rank": 1, "world": 2, "sum": 1.0, "x": 7}]
    assert result["left"]  # the call joined the cluster and left it
