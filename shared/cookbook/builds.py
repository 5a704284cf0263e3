"""A package compiled against another torch build (PyPI's CUDA torchvision beside a CPU torch) is one line, not a
traceback: `guard` (run by ``import cookbook``) wraps the import of torchvision and torchaudio, whose failure raises
`BrokenBuild` naming the install line of the matching build; an uncaught one prints ``error: <message>``, exit 2.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

from cookbook.errors import EXIT_USER_ERROR, chain, check_passed

_TORCH_BUILT = ("torchvision", "torchaudio")  # packages compiled against one torch build


class BrokenBuild(ImportError):
    """A `_TORCH_BUILT` package is installed but does not import beside this torch; the message says what to run."""


def install_line(package: str, reinstall: bool = False, spec: str | None = None) -> str:
    """The pip command that installs `package`'s build for the installed torch: torch 2.N pairs with torchvision
    0.(N+15) and torchaudio 2.N (another package: `spec`), from the PyTorch index of torch's build (cpu, cu128, ...)."""
    import torch

    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    paired = {"torchvision": f"0.{minor + 15}.*", "torchaudio": f"{major}.{minor}.*"}
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    build = f"cu{cuda.replace('.', '')}" if cuda else f"rocm{'.'.join(hip.split('.')[:2])}" if hip else "cpu"
    found = f"{package}=={paired[package]}" if package in paired else spec or package
    reinstalls = "--force-reinstall --no-deps " if reinstall else ""
    return f"pip install {reinstalls}'{found}' --index-url https://download.pytorch.org/whl/{build}"


def installed_version(package: str) -> str:
    """`` 1.2.3``, the installed version of `package` after a space, or ``""``."""
    from importlib import metadata

    try:
        return " " + metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def rebuild_hint(package: str, spec: str | None = None) -> str:
    """What to run when `package` (pinned as `spec`) is installed but not built for the installed torch."""
    import torch

    return (
        f"its build does not match torch {torch.__version__}: install the {package} build made for that torch: "
        f"`{install_line(package, reinstall=True, spec=spec)}`"
    )


class _Loader(importlib.abc.Loader):
    def __init__(self, package: str, inner: importlib.abc.Loader):
        self.package, self.inner = package, inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        try:
            self.inner.exec_module(module)
        except BrokenBuild:
            raise
        except Exception as exc:  # noqa: BLE001 - a compiled extension fails in many ways; all mean the same
            cause, name = (str(exc).strip().splitlines() or [""])[0], self.package
            raise BrokenBuild(
                f"{name}{installed_version(name)} is installed but does not import ({type(exc).__name__}: {cause}): "
                f"{rebuild_hint(name)}",
                name=name,
            ) from exc


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `_TORCH_BUILT` packages as the other finders do, and wraps their loader (`_Loader`)."""

    def find_spec(self, name, path=None, target=None):
        if name not in _TORCH_BUILT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _Loader):
                    spec.loader = _Loader(name, spec.loader)
                return spec
        return None


def broken_build_in(exc: BaseException | None) -> BrokenBuild | None:
    """The `BrokenBuild` that `exc` is or was raised from (transformers re-raises import failures), if any."""
    return next((e for e in chain(exc) if isinstance(e, BrokenBuild)), None)


def _excepthook(kind, exc, tb, _previous=sys.excepthook):
    if not check_passed():  # an import failed in a worker started during the launcher's check, which reports it
        os._exit(0)
    broken = broken_build_in(exc)
    if broken is None:
        return _previous(kind, exc, tb)
    print(f"error: {broken}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_USER_ERROR)


def guard() -> None:
    """Install the finder and the hook (once per process)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
        sys.excepthook = _excepthook
