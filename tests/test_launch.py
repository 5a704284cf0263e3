"""cookbook.launch: the process counts and the --check before any worker (what each torchrun recipe's launch.sh runs)."""


import pytest

from cookbook.launch import main, plan


@pytest.mark.parametrize("ngpu, nnodes, gpus, expected", [
    ("", "1", 0, (2, 1)),  # no GPU: 2 CPU processes
    ("", "2", 8, (8, 2)),  # every GPU of the node
    ("3", "1", 0, (3, 1)),  # CPU processes as asked
    ("4", "1", 8, (4, 1)),
])
def test_plan(ngpu, nnodes, gpus, expected):
    assert plan(ngpu, nnodes, gpus) == expected


@pytest.mark.parametrize("ngpu, nnodes, gpus, message", [
    ("0", "1", 0, "error: NGPU=0 is not a positive integer"),
    ("two", "1", 0, "error: NGPU=two is not a positive integer"),
    ("", "-1", 0, "error: NNODES=-1 is not a positive integer"),
    ("9", "1", 8, r"error: NGPU=9 but this node has 8 GPU\(s\)"),
])
def test_plan_refuses(ngpu, nnodes, gpus, message):
    with pytest.raises(SystemExit, match=message):
        plan(ngpu, nnodes, gpus)


def test_a_failed_check_stops_before_any_worker(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("import os, sys\n"
                      "open(os.path.join(os.path.dirname(__file__), 'calls'), 'a').write(' '.join(sys.argv[1:]) + '|' +"
                      " os.environ['COOKBOOK_WORLD_SIZE'] + '\\n')\n"
                      "sys.exit(2 if '--check' in sys.argv else 0)\n")
    (tmp_path / "tiny.yaml").write_text("{}\n")
    status = main(["--ngpu", "3", "--nnodes", "2", str(script), "--config", "tiny.yaml", "optim.lr=1e-3"])
    assert status == 2
    calls = (tmp_path / "calls").read_text().splitlines()  # only the check ran; the config was found beside train.py
    assert calls == [f"--check --config {tmp_path / 'tiny.yaml'} optim.lr=1e-3|6"]
    assert main(["--ngpu", "x", str(script), "--config", "tiny.yaml"]) == 2
    assert "error: NGPU=x is not a positive integer" in capsys.readouterr().err
    assert len((tmp_path / "calls").read_text().splitlines()) == 1  # nothing ran for the bad NGPU
