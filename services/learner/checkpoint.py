"""Sharded checkpoints of the learner (torch.distributed.checkpoint), resumable, never half-read.

Layout of ``{run_dir}/checkpoints/step_00000042/``:
    *.distcp, .metadata     model and optimizer state, sharded as FSDP holds them (DCP)
    rng_rank{r}.pt          torch / numpy / python RNG states of rank r
    trainer.json            step, lr schedule, and whatever the driver adds (data position, ...)
    COMPLETE                written last, by rank 0, after every rank finished writing

``latest_complete`` only ever returns a directory with ``COMPLETE``, so a checkpoint killed
mid-write is skipped and the previous one is used.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

MARKER = "COMPLETE"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def latest_complete(run_dir: str | Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / MARKER).is_file())
    return done[-1] if done else None


def saved_extra(path: Path) -> dict:
    """The driver's ``extra`` of a complete checkpoint, read without loading it (to decide whether to)."""
    return json.loads((Path(path) / "trainer.json").read_text())["extra"]


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_sharded(path: Path, model, optim, sched, step: int, rank: int, extra: dict) -> None:
    """Collective: every rank calls it with the same ``path``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if rank == 0 and path.exists():
        shutil.rmtree(path)  # an older, incomplete attempt at the same step
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=str(path))
    torch.save(rng_state(), path / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (path / "trainer.json").write_text(json.dumps({"step": step, "sched": sched.state_dict(), "extra": extra}))
        (path / MARKER).write_text("ok\n")
    dist.barrier()


def load_sharded(path: Path, model, optim, sched, rank: int) -> tuple[int, dict]:
    """Collective: restore model, optimizer, schedule and RNG; returns (step, the driver's extra)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint")
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    meta = json.loads((path / "trainer.json").read_text())
    sched.load_state_dict(meta["sched"])
    set_rng_state(torch.load(path / f"rng_rank{rank}.pt", weights_only=False))
    return int(meta["step"]), meta["extra"]
