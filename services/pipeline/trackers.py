"""Where a run's metrics go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow.

    train.loggers: [tensorboard, wandb, mlflow]      # deploy/configs/*.yaml, or train.loggers=[...] on the command line

    trackers = open_trackers(cfg, run_dir, job="train", resume_step=12)   # RunLog forwards every row to them
    for t in trackers: t.log("train", 13, row); t.artifacts([path, ...]); t.close(ok=True)

TensorBoard writes scalars under ``<run_dir>/tb`` (``<kind>/<metric>`` tags). W&B and MLflow each get
one tracked run per run folder (``mempo train``'s, and its ``sft/`` folder for ``mempo sft``): the
resolved config as its parameters, every metrics row at its step (the same ``<kind>/<metric>``
names), and the files a command writes (the report, eval.json, curves, view.html) as artifacts.
The tracked run's id is kept in ``<folder>/trackers.json``, so a resumed run, and the ``mempo eval``
of a trained folder, go on in the same tracked run.

W&B runs offline when no key is set (``train.wandb_mode: auto``): its files stay under
``<run_dir>/wandb`` and ``wandb sync <run_dir>/wandb/offline-run-*`` uploads them later. MLflow logs
to ``train.mlflow_tracking_uri`` or, by default, a file store in ``<run_dir>/mlruns``
(``mlflow ui --backend-store-uri <run_dir>/mlruns``). Both packages are optional: a logger whose
package is missing is an error naming how to install it, raised before any work starts
(:func:`check_loggers`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import time
from pathlib import Path

log = logging.getLogger("mempo.run")
STATE = "trackers.json"
INSTALL = {"wandb": "pip install wandb", "mlflow": "pip install mlflow-skinny"}


def scalar(v) -> float | None:
    """``v`` as a finite float, or None (strings, booleans, NaN, infinities are not metrics)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def check_loggers(loggers) -> None:
    """Import each chosen logger's package now: a missing one is an ImportError naming how to install it."""
    for name in loggers:
        if name in INSTALL:
            try:
                __import__(name)
            except ImportError:
                raise ImportError(f"train.loggers has {name}, but the {name} package is not installed: "
                                  f"{INSTALL[name]} (or pip install -e '.[tracking]')") from None


def flat_params(cfg) -> dict[str, str]:
    """The resolved config as ``section.field -> value`` strings (MLflow parameters)."""
    out = {}
    for section, fields in cfg.model_dump(mode="json").items():
        for name, value in (fields.items() if isinstance(fields, dict) else [("", fields)]):
            text = value if isinstance(value, str) else json.dumps(value)
            out[f"{section}.{name}" if name else section] = text[:6000]
    return out


def _state(folder: Path) -> dict:
    try:
        return json.loads((folder / STATE).read_text())
    except (OSError, ValueError):
        return {}


def _save_state(folder: Path, key: str, value) -> None:
    state = _state(folder)
    state[key] = value
    tmp = folder / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(folder / STATE)


class TensorBoard:
    """Scalars under ``<folder>/tb``; steps after ``resume_step`` of an earlier run are purged."""

    def __init__(self, folder: Path, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter  # torch, on use

        self.writer = SummaryWriter(str(folder / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, kind: str, step: int, row: dict) -> None:
        for k, v in row.items():
            x = scalar(v)
            if x is not None and k not in ("step", "time"):
                self.writer.add_scalar(f"{kind}/{k}", x, step)
        self.writer.flush()

    def artifacts(self, paths) -> None:
        pass  # the files are beside tb/ already

    def close(self, ok: bool = True) -> None:
        self.writer.close()


class Wandb:
    """One W&B run per folder, resumed by its id (``trackers.json``); offline without a key."""

    def __init__(self, cfg, folder: Path, job: str, resume_step: int):
        import wandb  # optional (check_loggers)

        mode = cfg.train.wandb_mode
        if mode == "auto":
            mode = "online" if _wandb_key() else "offline"
        run_id = _state(folder).get("wandb") or secrets.token_hex(4)  # W&B ids: [a-z0-9], 8 here
        self.name = _run_name(folder, job)
        self.run = wandb.init(project=cfg.train.wandb_project, name=self.name, job_type=job,
                              id=run_id, resume="allow", dir=str(folder), mode=mode,
                              config=cfg.model_dump(mode="json"),
                              settings=wandb.Settings(silent=True, console="off"))
        self.run.config.update({"resumed_at_step": resume_step}, allow_val_change=True)
        _save_state(folder, "wandb", run_id)
        self.wandb = wandb
        log.info("W&B run %s (%s) in %s", run_id, mode, folder / "wandb")

    def log(self, kind: str, step: int, row: dict) -> None:
        data = {f"{kind}/{k}": x for k, v in row.items() if k not in ("step", "time") and (x := scalar(v)) is not None}
        if data:
            self.run.log(data, step=step)

    def artifacts(self, paths) -> None:
        paths = [Path(p) for p in paths if Path(p).is_file()]
        if paths:
            art = self.wandb.Artifact(re.sub(r"[^A-Za-z0-9_.-]", "-", self.name), type="run-files")
            for p in paths:
                art.add_file(str(p))
            self.run.log_artifact(art)

    def close(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Mlflow:
    """One MLflow run per folder in ``train.mlflow_experiment``, resumed by its id (``trackers.json``)."""

    def __init__(self, cfg, folder: Path, job: str, resume_step: int):
        uri = cfg.train.mlflow_tracking_uri or (folder / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow >= 3 keeps its file store in maintenance mode, behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param, RunStatus  # optional (check_loggers)
        from mlflow.tracking import MlflowClient

        self.Metric, self.RunStatus = Metric, RunStatus
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(cfg.train.mlflow_experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.train.mlflow_experiment)
        run_id = _state(folder).get("mlflow")
        if run_id and not _mlflow_run_exists(self.client, run_id):
            log.warning("MLflow run %s of %s is not in %s; starting a new one", run_id, folder, uri)
            run_id = None
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            self.client.set_tag(run_id, "mempo.resumed_at_step", str(resume_step))
        else:
            run_id = self.client.create_run(exp_id, run_name=_run_name(folder, job),
                                            tags={"mempo.job": job, "mempo.folder": str(folder)}).info.run_id
            params = [Param(k, v) for k, v in flat_params(cfg).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
                self.client.log_batch(run_id, params=params[i:i + 100])
            _save_state(folder, "mlflow", run_id)
        self.run_id = run_id
        log.info("MLflow run %s at %s", run_id, uri)

    def log(self, kind: str, step: int, row: dict) -> None:
        ms = int(row.get("time", time.time()) * 1000)
        metrics = [self.Metric(_mlflow_key(f"{kind}/{k}"), x, ms, step) for k, v in row.items()
                   if k not in ("step", "time") and (x := scalar(v)) is not None]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def artifacts(self, paths) -> None:
        for p in paths:
            if Path(p).is_file():
                self.client.log_artifact(self.run_id, str(p))

    def close(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "KILLED")


def _mlflow_run_exists(client, run_id: str) -> bool:
    try:
        client.get_run(run_id)
        return True
    except Exception:  # MlflowException (RESOURCE_DOES_NOT_EXIST), or a store that cannot say
        return False


def _mlflow_key(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", key)  # MLflow's allowed metric-name characters


def _run_name(folder: Path, job: str) -> str:
    name = folder.resolve().name
    return name if job != "sft" else f"{folder.resolve().parent.name}-sft"


def open_trackers(cfg, folder: str | Path, job: str, resume_step: int = 0, tensorboard: bool | None = None) -> list:
    """The trackers ``cfg.train.loggers`` names for the run folder ``folder`` (``job``: sft, train, eval);
    ``tensorboard`` overrides whether TensorBoard is among them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    loggers = list(cfg.train.loggers) if cfg is not None else ["tensorboard"]
    if tensorboard is not None:
        loggers = [n for n in loggers if n != "tensorboard"] + (["tensorboard"] if tensorboard else [])
    check_loggers(loggers)
    out = []
    for name in dict.fromkeys(loggers):
        if name == "tensorboard":
            try:
                out.append(TensorBoard(folder, resume_step))
            except ImportError:  # tensorboard is a dependency; a trimmed install still logs JSONL
                log.warning("tensorboard is not installed; metrics go to %s only", folder / "metrics.jsonl")
        elif name == "wandb":
            out.append(Wandb(cfg, folder, job, resume_step))
        elif name == "mlflow":
            out.append(Mlflow(cfg, folder, job, resume_step))
    return out


def track_results(cfg, folder: str | Path, job: str, step: int, results: dict, files: list) -> None:
    """Held-out tables (``{policy: {k: {metric: value}}}``) into the folder's tracked run (W&B, MLflow; the one
    ``mempo train`` opened there, when there is one) as ``eval/<policy>/k<k>/<metric>`` at ``step``, and
    ``files`` (reports, plots, the page) as its artifacts. Nothing when only TensorBoard is chosen."""
    if not set(cfg.train.loggers) - {"tensorboard"}:
        return
    row = {f"{name}/k{k}/{metric}": value for name, table in results.items() for k, cols in table.items()
           for metric, value in cols.items()}
    for tracker in open_trackers(cfg, folder, job, step, tensorboard=False):
        tracker.log("eval", step, row)
        tracker.artifacts(files)
        tracker.close(ok=True)
