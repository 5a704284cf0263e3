"""What a recipe needs installed: the trackers' packages (`TRACKERS`), a recipe's own (`require`, read from its
requirements file by `pinned`), and the one line for an import that failed (`import_error_line`)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Sequence

from cookbook import builds
from cookbook.errors import ConfigError, chain

# The `trackers` key's names -> (the module that writes it, its pip packages, the requirements file that pins them).
TRACKERS = {
    "mlflow": ("mlflow", "mlflow-skinny==3.17.2 sqlalchemy==2.0.44 alembic==1.17.1", "requirements/base.txt"),
    "tensorboard": ("tensorboardX", "tensorboardX==2.6.5", "requirements/base.txt"),
    "wandb": ("wandb", "wandb==0.31.0", "requirements/trackers.txt"),
}
# The viewers a run's closing lines name: tracker -> the pip package (pinned as in TRACKER_UIS_FILE).
TRACKER_UIS = {"mlflow": "mlflow==3.17.2", "tensorboard": "tensorboard==2.21.0"}  # mlflow: the full one, with its UI
TRACKER_UIS_FILE = "requirements/trackers.txt"


def install_hint(packages: str, requirements: str | Path) -> str:
    """```pip install P`, or `pip install -r F` from the cookbook repository's root`` (`requirements` absolute: no
    "from ...")."""
    where = "" if Path(requirements).is_absolute() else " from the cookbook repository's root"
    return f"`pip install {packages}`, or `pip install -r {requirements}`{where}"


def check_trackers(trackers: Sequence[str]) -> None:
    """Raise ConfigError for a tracker name not in `TRACKERS`, or one whose package is not installed."""
    for name in trackers:
        if name not in TRACKERS:
            raise ConfigError(
                f"trackers: unknown tracker {name!r}; choose from {', '.join(TRACKERS)} (metrics.jsonl is always written)"
            )
        module, packages, requirements = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"trackers: {name} is selected but the {module} package is not installed: "
                f"{install_hint(packages, requirements)}"
            )


def pinned(package: str, requirements: str | Path) -> str:
    """`package` as the file `requirements` (relative: to the repository's root) pins it (``ray[train]==2.60.0``), or
    `package` itself where the file or its line is not found."""
    path = Path(requirements)
    if not path.is_absolute():
        path = Path(__file__).resolve().parents[2] / path  # shared/cookbook/requirements.py -> the repository's root
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return package
    name = _project_name(package)
    specs = (line.split("#")[0].strip() for line in lines)
    return next((spec for spec in specs if spec and _project_name(spec) == name), package)


def _project_name(spec: str) -> str:
    """The project of a requirement specifier, compared as pip does: ``Ray[train]==2.60`` -> ``ray``."""
    for stop in "[=<>!~ ;":
        spec = spec.split(stop, 1)[0]
    return spec.lower().replace("_", "-").replace(".", "-")


def require(module: str, requirements: str | Path, *, torch_build: bool = False) -> None:
    """Raise ConfigError (one line) for a package `module` that is not installed or does not import; `requirements`:
    the file that pins it; `torch_build`: compiled against torch, so the line names the build for this torch."""
    spec = pinned(module, requirements)
    name = _project_name(spec)
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever the import raises is one line for the user
        if isinstance(exc, ModuleNotFoundError) and exc.name == module.split(".")[0]:
            if torch_build:  # PyPI's build is made for PyPI's CUDA torch: name the one for the installed torch
                import torch

                raise ConfigError(
                    f"{module} is not installed: `{builds.install_line(name, spec=spec)}` (the "
                    f"build for torch {torch.__version__})"
                ) from None
            raise ConfigError(f"{module} is not installed: {install_hint(spec, requirements)}") from None
        found = builds.broken_build_in(exc)
        if found is not None:  # cookbook.builds names the build to install
            raise ConfigError(str(found)) from None
        broken = f"{module}{builds.installed_version(name)} is installed but does not import ({_cause_line(exc)})"
        if torch_build:
            raise ConfigError(f"{broken}: {builds.rebuild_hint(name, spec)}") from None
        raise ConfigError(f"{broken}; install it again: {install_hint(spec, requirements)}") from None


def _cause_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of the innermost exception `exc` was raised from, with its class unless an import error."""
    exc = chain(exc)[-1]
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text if isinstance(exc, ImportError) else f"{type(exc).__name__}: {text}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def import_error_line(exc: ImportError, requirements: str | Path | None = None) -> str:
    """The one line `cookbook.run_main` prints for an ImportError that ended a process (exit 2, not restarted): the
    module, the innermost cause, and the install line of `requirements` or else of the recipe's README."""
    name = next((e.name for e in chain(exc) if isinstance(e, ImportError) and e.name), None)
    what = f"importing {name.split('.')[0]} failed" if name else "an import failed"
    fix = f"`pip install -r {requirements}`" if requirements else "its README's install line"
    return (
        f"{what} ({_cause_line(exc)}): a restart cannot install or repair a package; install the recipe's "
        f"requirements ({fix})"
    )
