"""Where a run's metrics go besides ``metrics.jsonl``: the MLflow, TensorBoard and W&B sinks (the config's
``trackers``) of `cookbook.metrics.MetricsLogger`, and the masking of credentials in the URIs they show
(`redact_uri`). What each writes, where, and how a resumed run continues it: docs/outputs.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from cookbook.config import flatten
from cookbook.requirements import TRACKER_UIS, TRACKER_UIS_FILE, install_hint
from cookbook.dist import get_logger


_SECRET_QUERY = ("token", "key", "secret", "password", "passwd", "pwd", "auth", "signature", "credential")
_TRACKING_URI_VARIABLES = ("MLFLOW_TRACKING_URI", "WANDB_BASE_URL")  # URIs of trackers, from the environment


def _secret(key: str) -> bool:
    return any(s in key.lower() for s in _SECRET_QUERY) or key.lower() == "sig"


def redact_uri(uri: str | None) -> str | None:
    """`uri` with its password (``https://user:pw@host``) and secret-looking query values (``?token=``) as ``***``."""
    if not uri:
        return uri
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "***"
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username}:***@{netloc.rsplit('@', 1)[1]}"
    elif "@" in netloc and parts.scheme not in ("file", "sqlite"):  # a bare token as the user name
        netloc = f"***@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if _secret(k) else v) for k, v in pairs], safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return uri  # nothing to mask (rebuilding would drop the empty authority of sqlite:////abs/path)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redact_text(text: str) -> str:
    """`text` with the secrets `redact_uri` masks in the environment's tracking URIs as ``***``, wherever."""
    secrets = set()
    for uri in (os.environ.get(v) for v in _TRACKING_URI_VARIABLES):
        if not uri or redact_uri(uri) == uri:
            continue
        try:
            parts = urlsplit(uri)
        except ValueError:
            secrets.add(uri)
            continue
        if parts.password:
            secrets.update({parts.password, unquote(parts.password)})
        elif "@" in parts.netloc and parts.username:
            secrets.update({parts.username, unquote(parts.username)})
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if v and _secret(k):
                secrets.add(v)
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


class Sink:
    """A tracker beside ``metrics.jsonl`` that switches itself off, with one warning line, at its first failure;
    `_start` opens its run in `out_dir` (a resumed run continues the one whose id is in ``<out_dir>/<id_file>``);
    `where`, while `enabled`: where the run is and the command that shows it, for the closing lines."""

    name = id_file = ""
    run_id = tracking_uri = None

    def __init__(self, out_dir: Path, run_name: str, experiment: str, params: Mapping[str, Any]) -> None:
        self.enabled = True
        self._run_id_file = out_dir / self.id_file
        self._guard(self._start, out_dir, run_name, experiment, params)

    def _guard(self, fn, *args) -> None:
        if not self.enabled:
            return
        try:
            fn(*args)
        except Exception as exc:  # tracking must never stop training
            self.enabled = False
            first = (str(exc).strip().splitlines() or [""])[0]  # SQLAlchemy's go on with the SQL and a link
            why = _redact_text(f"{type(exc).__name__}: {first}")  # a message may quote a tracking URI with its token
            get_logger().warning(f"{self.name} tracking switched off after an error: {why}")

    def _last_run_id(self, variable: str) -> str | None:
        """The run to continue: the environment's `variable`, else the id stored in the output folder."""
        path = self._run_id_file
        return os.environ.get(variable) or ((path.read_text().strip() or None) if path.is_file() else None)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Write numbers of one step (names as in the JSONL records)."""
        self._guard(self._log, metrics, step)

    def close(self, status: str = "FINISHED") -> None:
        """End the run: ``FINISHED``, ``FAILED`` or ``KILLED`` (stopped early, to be resumed)."""
        self._guard(self._close, status)


def _browse(command: str, tracker: str, module: str, note: str = "") -> str:
    """``browse with `command` ``, with the pip line of its UI when `module` (the UI's) is not installed."""
    if importlib.util.find_spec(module) is not None:
        return f"browse with `{command}`"
    return f"browse with `{command}` (after {install_hint(TRACKER_UIS[tracker], TRACKER_UIS_FILE)}{note})"


class MLflowSink(Sink):
    """MLflow: ``MLFLOW_TRACKING_URI``, else an embedded SQLite store in the output folder."""

    name, id_file = "MLflow", "mlflow_run_id.txt"

    def _start(self, out_dir: Path, run_name: str, experiment: str, params: Mapping[str, Any]) -> None:
        import mlflow

        self._mlflow = mlflow
        for name in ("alembic", "mlflow"):  # after the import, which sets mlflow's own level
            logging.getLogger(name).setLevel(logging.WARNING)
        # its ~40-line traceback of each database error, before re-raising it: _guard's one line says it
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)

        users = os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri = users or f"sqlite:///{out_dir.resolve()}/mlflow.db"
        mlflow.set_tracking_uri(self.tracking_uri)
        if users is None:  # mlflow also exports it into os.environ, where the next run of this process (a notebook
            os.environ.pop("MLFLOW_TRACKING_URI", None)  # cell, a forked worker) would take it for the user's
        run_id = self._last_run_id("MLFLOW_RUN_ID")
        if not run_id:
            mlflow.set_experiment(experiment)
        run = mlflow.start_run(run_id=run_id or None, run_name=None if run_id else run_name)
        self.run_id = run.info.run_id
        self._run_id_file.write_text(self.run_id)
        with contextlib.suppress(Exception):  # already logged with other values (a resume with overrides)
            mlflow.log_params({k: str(v)[:500] for k, v in flatten(params).items()})  # it sends 100 at a time

    def _log(self, metrics: Mapping[str, float], step: int) -> None:
        self._mlflow.log_metrics({k.replace("/", "_"): float(v) for k, v in metrics.items()}, step=step)

    def _close(self, status: str) -> None:
        self._mlflow.end_run(status=status)

    def where(self) -> str:
        uri = redact_uri(self.tracking_uri)
        if uri is not None and uri.startswith(("http://", "https://", "databricks")):
            return f"{uri} (run {self.run_id})"  # a server: its own UI shows the run
        ui = _browse(f"mlflow ui --backend-store-uri {uri}", "mlflow", "flask", "; mlflow-skinny has no UI")
        return f"{uri} (run {self.run_id}); {ui}"


class _TensorBoardSink(Sink):
    """TensorBoard event files in ``<out_dir>/tensorboard`` (written with tensorboardX), one scalar per key."""

    name = "TensorBoard"

    def _start(self, out_dir: Path, run_name: str, experiment: str, params: Mapping[str, Any]) -> None:
        from tensorboardX import SummaryWriter

        self.log_dir = out_dir / "tensorboard"
        self._writer = SummaryWriter(logdir=str(self.log_dir), flush_secs=10)
        table = "\n".join(f"| {k} | {str(v)[:500]} |" for k, v in flatten(params).items())
        self._writer.add_text("config", "| key | value |\n|---|---|\n" + table, 0)

    def _log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, float(v), step)
        self._writer.flush()

    def _close(self, status: str) -> None:
        self._writer.close()

    def where(self) -> str:
        return f"{self.log_dir}; {_browse(f'tensorboard --logdir {self.log_dir}', 'tensorboard', 'tensorboard')}"


class _WandbSink(Sink):
    """Weights & Biases: online when ``WANDB_API_KEY`` is set, else offline into ``<out_dir>/wandb``
    (``WANDB_MODE`` decides when set); a resumed run continues its W&B run (``wandb_run_id.txt``)."""

    name, id_file = "W&B", "wandb_run_id.txt"

    def _start(self, out_dir: Path, run_name: str, experiment: str, params: Mapping[str, Any]) -> None:
        self.mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        import wandb

        run_id = self._last_run_id("WANDB_RUN_ID")
        settings = wandb.Settings(console="off", silent=True, disable_git=True, save_code=False)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or experiment,
            name=run_name,
            dir=str(out_dir),
            config=dict(params),
            mode=self.mode,
            id=run_id,
            resume="allow" if run_id else None,
            settings=settings,
        )
        self._run_id_file.write_text(self._run.id)

    def _log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def _close(self, status: str) -> None:
        import wandb

        if status == "KILLED":
            self._run.mark_preempting()
        self._run.finish(exit_code=1 if status == "FAILED" else 0)
        wandb.teardown()  # waits until W&B's service has written everything (finish alone does not, offline)

    def where(self) -> str:
        if self.mode == "offline":
            folder = Path(self._run.dir).parent  # <out_dir>/wandb/offline-run-<time>-<id>
            return f"{folder} (offline); upload with `wandb sync {folder}`"
        return f"{redact_uri(self._run.url)} (run {self._run.id})"


SINKS = {"mlflow": MLflowSink, "tensorboard": _TensorBoardSink, "wandb": _WandbSink}  # the `trackers` key's names
