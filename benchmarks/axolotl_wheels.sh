#!/usr/bin/env bash
# Fill ./.whl-axo (repository root, git-ignored) with the Python 3.12 x86_64 wheels that `axolotl train` of
# recipes/axolotl-lora-ddp needs on the GPU image (torch 2.11 CUDA 13, numba, llvmlite, triton 3.6, numpy, pandas,
# pyarrow, safetensors, tokenizers, pyyaml, rich, tqdm, psutil, pillow, cloudpickle are there already): axolotl
# 0.19.0, its pinned transformers, trl, peft, accelerate, datasets, huggingface_hub, pydantic, the packages it
# imports on the way to training, bitsandbytes 0.50.2 reduced to its CPU and CUDA 13.0 libraries and wandb 0.31.0
# without its Go binaries (Axolotl imports both also for 16-bit LoRA; 43 -> 3.4 MB and 20 -> 1.2 MB). Everything
# is installed with --no-deps, so nothing outside this list is pulled. About 27 MB.
#   bash benchmarks/axolotl_wheels.sh          # from the repository root; ~40 s
# On the device: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/axo-site .whl-axo/*.whl
# and put /tmp/axo-site first on PYTHONPATH (benchmarks/unsloth_axolotl_vs_trl.sh does).
set -euo pipefail
dest=${1:-.whl-axo}
mkdir -p "$dest"
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.whl-axo/' "$exclude" 2>/dev/null || echo '/.whl-axo/' >> "$exclude"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# Axolotl's own pins (its METADATA) for what it imports at train time, then the unpinned packages it imports.
# tokenizers (pinned ==0.23.1) is left to the image: transformers 5.16.1 and the image's 5.17 both check
# tokenizers>=0.23.1,<0.24 at import, and its 3.3 MB wheel does not fit beside .whl and the data in one call.
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dest" \
  axolotl==0.19.0 transformers==5.16.1 trl==1.9.0 peft==0.20.0 accelerate==1.13.0 datasets==4.8.4 \
  huggingface_hub==1.17.0 pydantic==2.12.5 pydantic_core==2.41.5 posthog==6.7.11 evaluate==0.4.1 \
  'kernels>=0.16,<0.17' kernels-data tomlkit annotated_types typing_inspection colorama fire termcolor addict \
  fastcore backoff distro six requests urllib3 'dill<0.4.1' 'multiprocess<0.70.19' xxhash \
  platformdirs 'protobuf<8' opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions "$@"
# charset_normalizer (for requests): its pure-Python wheel, not the compiled one the platform flags would pick.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py --platform any \
  -d "$dest" charset_normalizer
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# axolotl-contribs-mit / -lgpl are published as source only: build their pure-Python wheels.
python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" axolotl-contribs-mit==0.0.6 axolotl-contribs-lgpl==0.0.7
python3 -m pip wheel -q --no-deps -w "$dest" "$tmp"/axolotl_contribs_*.tar.gz
# Two wheels reduced (the same wheel less some binary files, RECORD rewritten to match):
#   bitsandbytes 0.50.2: keep the CPU and CUDA 13.0 libraries (the image's torch is CUDA 13.0), drop the others;
#   wandb 0.31.0 (axolotl.utils.callbacks imports it): drop wandb/bin (wandb-core and its helpers), which only a
#     W&B run (use_wandb) would start.
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" bitsandbytes==0.50.2 wandb==0.31.0
strip="$(dirname "$0")/strip_wheel.py"
python3 "$strip" "$dest" "$tmp"/bitsandbytes-0.50.2-*.whl '/libbitsandbytes_(?!(cpu|cuda130)\.so$)[^/]*\.so$'
python3 "$strip" "$dest" "$tmp"/wandb-0.31.0-*.whl '^wandb/bin/'
ls -la "$dest"; du -sh "$dest"
