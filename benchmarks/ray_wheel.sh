#!/usr/bin/env bash
# A reduced ray wheel that fits a device call's carry (64 MiB with everything else): ray 2.60.0's manylinux wheel
# (79 MB) without the parts a single-node Ray Train run of this repository never loads, and with the symbol tables
# of its native programs and extensions stripped. Dropped:
#   - ray/jars/ (32 MB compressed: the Java worker, for cross-language actors),
#   - ray/dashboard/client/build/ (the dashboard's web UI; the recipes start Ray with include_dashboard=False),
#   - ray/rllib/, ray/serve/, ray/llm/ (RLlib, Serve, ray.llm: not imported by ray.train / ray.tune / ray.data,
#     which reach RLlib only inside a try/except ImportError in ray.tune.registry),
#   - every tests/ and examples/ folder, *.pyi stubs.
# `strip --strip-unneeded` removes the symbol tables (.symtab/.strtab) of ray/_raylet.so, gcs_server, raylet and the
# bundled extensions; it keeps what the dynamic loader needs (.dynsym), so the programs run as before but their stack
# traces name no static functions. RECORD is rewritten with the new files' sha256 and sizes.
#
#   bash benchmarks/ray_wheel.sh                 # cp312 (the GPU image's Python 3.12) into .whl-ray/
#   PY=3.11 WHL_DIR=/tmp/ray311 bash benchmarks/ray_wheel.sh   # the same for cp311 (a CPU check here)
#   RAY_WHEEL=/path/ray-2.60.0-cp312-...whl bash benchmarks/ray_wheel.sh   # reduce a wheel already downloaded
#
# Needs pip (to download the wheel from PyPI unless RAY_WHEEL is given), unzip-free Python 3 and binutils' strip.
# The GPU image has ray's other requirements (click, filelock, msgpack, packaging, protobuf, pyyaml, requests; pandas,
# pyarrow, fsspec for ray.train; pydantic comes with .whl/) but not jsonschema, which `import ray` needs
# (ray.runtime_env imports it at module level): its wheels (jsonschema, jsonschema-specifications, referencing,
# rpds-py, ~0.6 MB; JSONSCHEMA_PINS) are downloaded beside the reduced ray. On the device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-ray/*.whl
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${PY:-3.12}
VERSION=${RAY_VERSION:-2.60.0}
WHL_DIR=${WHL_DIR:-$ROOT/.whl-ray}
command -v strip > /dev/null || { echo "ray_wheel.sh: strip (binutils) not found" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [[ -z ${RAY_WHEEL:-} ]]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux2014_x86_64 -d "$tmp/dl" "ray==$VERSION"
  RAY_WHEEL=$(ls "$tmp"/dl/ray-*.whl)
fi
mkdir -p "$WHL_DIR"
rm -f "$WHL_DIR"/*.whl
# jsonschema and its needs at the versions pip resolved beside ray 2.60.0 for requirements/base.txt
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHL_DIR" \
  ${JSONSCHEMA_PINS:-jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1}
python3 - "$RAY_WHEEL" "$WHL_DIR" "$tmp" <<'PY'
import base64, hashlib, os, re, subprocess, sys, zipfile
from pathlib import Path

src, out_dir, tmp = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
DROP = re.compile(r"^ray/(jars|dashboard/client/build|rllib|serve|llm)/|/(tests|examples)/|\.pyi$")
ELF = b"\x7fELF"


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


zin = zipfile.ZipFile(src)
record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
out = out_dir / src.name
kept = dropped = stripped_saved = 0
records = []
with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        name = info.filename
        if name == record_name or name.endswith("/"):
            continue
        if DROP.search(name):
            dropped += info.file_size
            continue
        data = zin.read(name)
        if data[:4] == ELF:
            f = tmp / "elf"
            f.write_bytes(data)
            subprocess.run(["strip", "--strip-unneeded", str(f)], check=True)
            new = f.read_bytes()
            stripped_saved += len(data) - len(new)
            data = new
        zi = zipfile.ZipInfo(name, date_time=info.date_time)
        zi.external_attr = info.external_attr  # keeps the executables' mode bits (gcs_server, raylet)
        zi.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(zi, data, compresslevel=9)
        records.append(record_line(name, data))
        kept += len(data)
    records.append(f"{record_name},,")
    zout.writestr(record_name, "\n".join(records) + "\n")
print(f"{src.name}: {src.stat().st_size / 2**20:.1f} MiB -> {out.stat().st_size / 2**20:.1f} MiB "
      f"({dropped / 2**20:.1f} MiB of files dropped, {stripped_saved / 2**20:.1f} MiB of symbols stripped, "
      f"{kept / 2**20:.1f} MiB installed)")
PY
ls -la "$WHL_DIR"
du -sh "$WHL_DIR"
