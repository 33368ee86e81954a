"""Sharded checkpoints of the learner (torch.distributed.checkpoint), resumable, never half-read.

Layout of ``{run_dir}/checkpoints/step_00000042/``:
    *.distcp, .metadata     model and optimizer state, sharded as FSDP holds them (DCP); with LoRA the
                            model part is the adapters only (the base is ``model.path``)
    rng_rank{r}.pt          torch / numpy / python RNG states of rank r
    trainer.json            step, lr schedule, world size, and whatever the driver adds (data position, ...)
    COMPLETE                written last, by rank 0, after every rank finished writing

``latest_complete`` only ever returns a directory with ``COMPLETE``, so a checkpoint killed
mid-write is skipped and the previous one is used.

A checkpoint written by W ranks loads on any number W' of ranks: DCP reads each rank's shards of
the model and optimizer state from whichever saved files hold them (resharding). The RNG states
are per rank, so they are mapped by a stated rule: rank r of W' takes the state saved by rank
``r % W``. Ranks present in both runs keep their own stream; a new rank (r >= W) starts from the
stream of the rank it maps to. Every rank seeds its RNGs alike at start (``train.seed``), so this
is the state a fresh group of W' ranks would have had, advanced as far as the saved run advanced.
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


def _model_state(model, kept: dict | None) -> dict:
    """The model's part of a checkpoint: every parameter, or with LoRA (``kept``) the adapters only."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # torch.distributed on use

    state = get_model_state_dict(model)
    if kept is None:
        return state
    from services.common.lora import adapter_state  # peft on use

    return adapter_state(state)


def _check_kept(path: Path, meta: dict, kept: dict | None) -> None:
    """A checkpoint resumes only into a learner that trains what it holds: all parameters, or LoRA
    adapters made by the same ``learner.lora`` settings."""
    saved = meta.get("kept")
    if (saved is None) != (kept is None):
        has = "LoRA adapters" if saved is not None else "every parameter"
        wants = "LoRA adapters" if kept is not None else "every parameter"
        raise ValueError(f"{path} holds {has} but this learner trains {wants} (learner.lora.rank): resume with the "
                         f"settings it was made with, or start a new train.run_dir")
    if saved is not None and saved["lora"] != kept["lora"]:
        raise ValueError(f"{path} holds LoRA adapters made with learner.lora={saved['lora']}, this learner has "
                         f"{kept['lora']}: resume with the settings it was made with, or start a new train.run_dir")


def save_sharded(path: Path, model, optim, sched, step: int, rank: int, extra: dict, kept: dict | None = None) -> None:
    """Collective: every rank calls it with the same ``path``. ``kept`` (LoRA: the adapter settings) makes
    the checkpoint hold the adapters only and is recorded in trainer.json."""
    import torch.distributed as dist  # torch.distributed on use (the FSDP ranks)
    import torch.distributed.checkpoint as dcp  # torch.distributed on use (the FSDP ranks)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # (the same)

    if rank == 0 and path.exists():
        shutil.rmtree(path)  # an older, incomplete attempt at the same step
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    state = {"model": _model_state(model, kept), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=str(path))
    torch.save(rng_state(), path / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        meta = {"step": step, "sched": sched.state_dict(), "world_size": dist.get_world_size(), "extra": extra,
                **({"kept": kept} if kept is not None else {})}
        (path / "trainer.json").write_text(json.dumps(meta))
        (path / MARKER).write_text("ok\n")
    dist.barrier()


def saved_world_size(path: Path) -> int:
    """How many ranks wrote the checkpoint at ``path`` (older checkpoints: counted from their RNG files)."""
    meta = json.loads((Path(path) / "trainer.json").read_text())
    if "world_size" in meta:
        return int(meta["world_size"])
    ranks = sorted(int(p.stem.removeprefix("rng_rank")) for p in Path(path).glob("rng_rank*.pt"))
    if not ranks or ranks != list(range(len(ranks))):
        raise FileNotFoundError(f"{path}: the RNG states rng_rank0.pt .. are incomplete ({ranks}); "
                                f"the checkpoint cannot be resumed")
    return len(ranks)


def rng_file(path: Path, rank: int) -> Path:
    """The RNG state rank ``rank`` of the resuming group loads: the saved rank ``rank % W`` (module docstring)."""
    saved = saved_world_size(path)
    f = Path(path) / f"rng_rank{rank % saved}.pt"
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing: the checkpoint {path} (written by {saved} ranks) is damaged; "
                                f"remove it to resume from the one before, or set learner.resume=never")
    return f


def load_sharded(path: Path, model, optim, sched, rank: int, kept: dict | None = None) -> tuple[int, dict]:
    """Collective: restore model, optimizer, schedule and RNG; returns (step, the driver's extra). Any
    world size: the state is resharded and the RNG states mapped as the module docstring says. With
    LoRA (``kept``) the adapters are loaded onto the base the model was built from."""
    import torch.distributed.checkpoint as dcp  # torch.distributed on use (the FSDP ranks)
    from torch.distributed.checkpoint.state_dict import (  # torch.distributed on use (the FSDP ranks)
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint")
    meta = json.loads((path / "trainer.json").read_text())
    _check_kept(path, meta, kept)
    rng = rng_file(path, rank)  # checked before any state is touched
    state = {"model": _model_state(model, kept), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=kept is None))
    set_optimizer_state_dict(model, optim, state["optim"])
    sched.load_state_dict(meta["sched"])
    set_rng_state(torch.load(rng, weights_only=False))
    return int(meta["step"]), meta["extra"]
