"""The learner's FSDP group: W ``LearnerWorker`` actors (one per GPU, or per CPU slot) driven as one.

    group = LearnerGroup(cfg, model_dir)                 # W = cfg.learner.world_size
    metrics = group.train_step(training_batch)           # one PPO/GRPO update, all ranks
    metrics = group.sft_step(training_batch)             # one cross-entropy update
    state = group.full_state_dict()                      # gathered once, on rank 0
    group.shutdown()

The batch is encoded and put in the object store once; every rank reads the same bytes.

A call on the group has one outcome for all its ranks (``gather``): the results; ``RankLost`` when a
rank died, whichever rank's error reached the driver first (a survivor's collective error while a
peer is dead is the same fault, and the caller rebuilds the group: services/learner/service.py); or,
with every rank alive, the first error as it was raised.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from services.common.codec import encode
from services.config import MempoConfig, actor_options, learner_worker_gpus
from services.common.messages import TrainingBatch
from services.learner.checkpoint import latest_complete, step_dir
from services.learner.rendezvous import LOOPBACK, NODE
from services.learner.worker import LearnerWorker

log = logging.getLogger("mempo.learner")

_SUMMED = ("pg_loss", "kl", "entropy", "abs_diff", "tokens", "clip", "dual_clip", "sft_loss", "lag", "is_tokens",
           "is_weight", "is_truncated")


class RankLost(RuntimeError):
    """A call on the worker group failed because rank(s) ``ranks`` died: the group must be rebuilt.
    ``__cause__`` is the first error that reached the driver (the dead rank's, or a survivor's)."""

    def __init__(self, what: str, ranks: list[int], first: BaseException, first_rank: int):
        self.ranks = ranks
        said = "" if first_rank in ranks else (f"; rank {first_rank}'s error came first "
                                                f"({type(first).__name__}: {str(first).splitlines()[0][:200]})")
        super().__init__(f"{what}: learner rank(s) {ranks} died{said}")


def gather(refs: list, what: str, grace_s: float, on_hung=None) -> list:
    """The results of one call on every rank (``refs`` in rank order), read as one outcome.

    - Every rank answers: the results, in rank order.
    - A rank died (its ref raises ``RayActorError``), at any point before the call is judged: ``RankLost``,
      whichever rank's error arrived first. A rank whose peer dies mid-collective fails with its
      backend's error (gloo: "Connection closed by peer") before Ray has reported the peer dead; the
      other refs are waited for up to ``grace_s`` after the first error so that the death is seen.
    - Ranks raised and every rank is alive: the first error, as it was raised. Ranks still running
      ``grace_s`` after it (waiting in a collective for the rank that failed) are named in a note on
      it, and ``on_hung(ranks)`` runs before it is raised (``LearnerGroup`` kills the group there).
    """
    rank_of = {ref: r for r, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    errors: dict[int, BaseException] = {}  # in arrival order
    pending, deadline = list(refs), None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            break  # the grace is over
        for ref in ready:
            r = rank_of[ref]
            try:
                results[r] = ray.get(ref)
            except RayActorError as e:
                first_rank, first = next(iter(errors.items()), (r, e))
                raise RankLost(what, [r], first, first_rank) from first
            except Exception as e:  # noqa: BLE001 - judged below, once the others have answered or the grace is over
                errors[r] = e
                if deadline is None:
                    deadline = time.monotonic() + grace_s
    if not errors:
        return results
    first_rank, first = next(iter(errors.items()))
    if pending:
        stuck = sorted(rank_of[ref] for ref in pending)
        first.add_note(f"mempo: {what} failed on rank {first_rank} with every rank alive; rank(s) {stuck} had not "
                       f"answered {grace_s:g}s later (learner.fault_grace_s), most likely waiting in a collective "
                       f"for it")
        if on_hung is not None:
            on_hung(stuck)
    raise first


class LearnerGroup:
    worker_class = LearnerWorker  # the rank's actor class (tests inject faults through a subclass)

    def __init__(self, cfg: MempoConfig, model_dir: str, world_size: int | None = None):
        self.cfg = cfg
        self.world = world_size or cfg.learner.world_size
        options = actor_options(cfg.learner.num_cpus_per_worker, learner_worker_gpus(cfg), cfg.learner.resources)
        actor = ray.remote(**options)(self.worker_class)
        config = cfg.model_dump(mode="json")
        # rank 0 binds the rendezvous socket: loopback on one machine, its node's address on a cluster
        store_host = NODE if cfg.ray.address else LOOPBACK
        self.workers = [actor.remote(r, self.world, config, str(model_dir), store_host) for r in range(self.world)]
        host, port = ray.get(self.workers[0].store_address.remote())
        self.pids: list[int] = self._all("join", host, port)

    def _all(self, method: str, *args) -> list:
        """``method`` on every rank, one outcome (``gather``). A failure with ranks left hanging kills the
        whole group: its next call raises ``RankLost`` and the learner service rebuilds it."""
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return gather(refs, method, self.cfg.learner.fault_grace_s, on_hung=self._hung)

    def _hung(self, ranks: list[int]) -> None:
        log.error("learner group: a call failed on one rank while rank(s) %s hung; killing the group (its next call "
                  "rebuilds it)", ranks)
        self.kill()

    def kill(self) -> None:
        """Kill every rank's process (no clean shutdown: a rank may be stuck in a collective)."""
        for w in self.workers:
            ray.kill(w)

    def _combine(self, parts: list[dict]) -> dict:
        out = {k: sum(p.get(k, 0.0) for p in parts) for k in _SUMMED if k in parts[0]}
        n = max(out.get("tokens", 0.0), 1.0)
        for k in ("entropy", "abs_diff", "clip", "dual_clip"):
            if k in out:
                out[k] = out[k] / n
        if "abs_diff" in out:
            out["logprob_abs_diff_mean"] = out.pop("abs_diff")
            out["logprob_max_ratio"] = math.exp(max(p["max_abs_diff"] for p in parts))
        if "lag" in out:  # per loss token: versions behind, and the behaviour importance weights
            out["version_lag_token_mean"] = out.pop("lag") / n
            out["version_lag_token_max"] = max(p["lag_max"] for p in parts)
            weighted = out.pop("is_tokens")
            out["is_weighted_tokens"] = weighted
            out["is_weight_mean"] = out.pop("is_weight") / weighted if weighted else 1.0
            out["is_truncated_share"] = out.pop("is_truncated") / max(weighted, 1.0)
            out["is_weight_max"] = max(p["is_weight_max"] for p in parts)
        for k in ("grad_norm", "lr", "skipped_steps", "noise/groups", "noise/trace", "noise/signal_sq",
                  "masked_stale_tokens"):
            if k in parts[0]:  # the same on every rank (all-reduced)
                out[k] = parts[0][k]
        out["seconds"] = max(p["seconds"] for p in parts)
        return out

    def train_step(self, batch: TrainingBatch) -> dict:
        ref = ray.put(encode(batch))
        return self._combine(self._all("train_step", ref))

    def sft_step(self, batch: TrainingBatch) -> dict:
        ref = ray.put(encode(batch))
        return self._combine(self._all("sft_step", ref))

    def full_state_dict(self, form: str = "merged") -> dict:
        """Rank 0's state dict; with LoRA ``form`` is merged, peft or adapter (worker.full_state_dict)."""
        return next(sd for sd in self._all("full_state_dict", form) if sd is not None)

    def param_digest(self) -> float:
        return self._all("param_digest")[0]

    def set_lr(self, lr: float) -> None:
        self._all("set_lr", lr)

    def save_checkpoint(self, run_dir: str, step: int, extra: dict | None = None) -> str:
        path = str(step_dir(run_dir, step))
        self._all("save_checkpoint", path, extra or {})
        return path

    def resume(self, run_dir: str) -> dict | None:
        """Load the latest complete checkpoint of ``run_dir`` (``learner.resume: auto``); None if
        there is none. Returns {"step", "extra"} (the driver's data position and the like)."""
        path = latest_complete(run_dir)
        if path is None or self.cfg.learner.resume == "never":
            return None
        return self._all("load_checkpoint", str(path))[0]

    def export_hf(self, out_dir: str, source_dir: str) -> str:
        """A plain Hugging Face directory (save_pretrained + tokenizer) of the current policy, for
        vLLM and users. ``source_dir`` gives the config and tokenizer. Written beside and renamed.
        With LoRA the weights are merged, and ``out_dir/adapter`` holds the adapters alone as a PEFT
        folder whose base is ``source_dir`` (``PeftModel.from_pretrained(base, out_dir/adapter)``)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # transformers on use

        state = self.full_state_dict()  # in model.dtype: the export's dtype, whatever the source folder's
        dtype = next((v.dtype for v in state.values() if v.is_floating_point()), None)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source_dir), dtype=dtype)
        model.load_state_dict(state)
        out, tmp = Path(out_dir), Path(out_dir).with_name(Path(out_dir).name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(source_dir).save_pretrained(tmp)
        gen = Path(source_dir) / "generation_config.json"
        if gen.is_file():
            shutil.copy(gen, tmp / "generation_config.json")
        if self.cfg.learner.lora.rank > 0:
            from services.common.lora import to_peft_folder  # peft on use

            to_peft_folder(self.full_state_dict("peft"), source_dir, self.cfg.learner.lora, str(tmp / "adapter"))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)  # a finished export or the previous one, never a half-written directory
        return out_dir

    def optimizer_digest(self) -> float:
        return self._all("optimizer_digest")[0]

    def shutdown(self) -> None:
        try:
            self._all("shutdown")
        finally:
            self.kill()
