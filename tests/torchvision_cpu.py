"""Test-only: import PyPI's torchvision wheel beside the CPU build of torch, for the RetinaNet tests.

PyPI's torchvision 0.28.0 ships a ``_C.so`` linked against libtorch_cuda / libc10_cuda, which the CPU torch
lacks, so its custom ops never load and ``import torchvision`` fails in ``_meta_registrations.py``
(``RuntimeError: operator torchvision::nms does not exist``). No CPU torchvision wheel is reachable from CI
(download.pytorch.org is not). The README's test command installs the wheel with ``--no-deps --target
.torchvision-cpu`` (outside site-packages, so that transformers and the other tests never see it), and
`apply` makes it importable in this process only:

1. defines the ``torchvision::nms`` and ``torchvision::qnms`` schemas (the ops ``_meta_registrations.py``
   registers fake kernels for at import) with ``torch.library``, and a pure-PyTorch CPU kernel for ``nms``;
2. imports torchvision from `FOLDER`;
3. makes ``torchvision.extension._has_ops`` report True, so that ``torchvision.ops.nms`` calls that kernel.

RetinaNet needs no other compiled op (no RoIAlign); ``torchvision.io``'s image decoders stay unavailable
(the recipe decodes with PIL). Workers forked after `apply` inherit it. A user's install (CUDA torch +
torchvision, or CPU torch + the CPU torchvision from the PyTorch index) needs none of this.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

FOLDER = Path(__file__).resolve().parents[1] / ".torchvision-cpu"
INSTALL = "pip install --no-deps --target .torchvision-cpu torchvision==0.28.0"
_LIB: torch.library.Library | None = None


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression, the semantics of ``torchvision.ops.nms``.

    Args:
        boxes: (N, 4) boxes ``x1, y1, x2, y2``.
        scores: (N,) scores.
        iou_threshold: a box is dropped when its IoU with a kept, higher-scoring box is > this.

    Returns:
        int64 (K,) indices of the kept boxes, by decreasing score.
    """
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    order = torch.sort(scores, descending=True, stable=True).indices
    b = boxes[order].double()
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.maximum(b[:, None, :2], b[None, :, :2])
    rb = torch.minimum(b[:, None, 2:], b[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    iou = inter / (area[:, None] + area[None, :] - inter)
    suppressed = torch.zeros(len(order), dtype=torch.bool)
    over = (iou > iou_threshold).cpu()
    keep = []
    for i in range(len(order)):
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= over[i]
    return order[torch.tensor(keep, dtype=torch.int64, device=boxes.device)]


def apply() -> None:
    """Make ``import torchvision`` work in this process (see the module docstring); idempotent.

    Raises:
        RuntimeError: the wheel is not installed in `FOLDER` (the message gives the command).
    """
    global _LIB
    if "torchvision" in sys.modules:
        return
    if not (FOLDER / "torchvision" / "__init__.py").is_file():
        raise RuntimeError(f"torchvision for the CPU tests is not in {FOLDER}: run `{INSTALL}` in the repository root")
    _LIB = torch.library.Library("torchvision", "DEF")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.impl("nms", nms, "CPU")
    sys.path.insert(0, str(FOLDER))
    try:
        import torchvision
        import torchvision.extension
    finally:
        sys.path.remove(str(FOLDER))  # the package stays in sys.modules; nothing else is found there
    torchvision.extension._has_ops = lambda: True
    # torchmetrics decides once whether torchvision is installed (from the package metadata, which is not on
    # sys.path any more): tell it, and give torchmetrics.detection the classes it leaves out without torchvision.
    import importlib

    import torchmetrics.detection
    from torchmetrics.utilities import imports as tm_imports

    tm_imports._TORCHVISION_AVAILABLE.available = True
    tm_imports._TORCHVISION_AVAILABLE.message = "Requirement 'torchvision' met (tests/torchvision_cpu.py)"
    importlib.reload(torchmetrics.detection)
