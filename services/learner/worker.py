"""One FSDP2 training rank: a Ray actor holding a shard of the policy, its optimizer and a frozen
reference policy (for the KL term).

The model is sharded with ``fully_shard`` per decoder layer, then the root, over gloo on CPU or
NCCL on GPU (services/learner/shard.py: fp32 master weights with bf16/fp16 compute, optional
activation checkpointing); log-probs come chunk by chunk from the output head, at the loss
positions only (services/learner/logprobs.py); at start each rank logs its estimated peak memory
and warns when the micro-batch token budget will not fit (services/learner/memory.py).

Every rank receives the whole ``TrainingBatch`` (an ObjectRef resolves to the same bytes
everywhere) and trains on its share of the micro-batches; losses are normalised by counts over
the whole batch, so the ranks' gradients sum to the full-batch gradient.

Driven by ``services/learner/group.py``; not meant to be called by hand.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.codec import decode
from services.config import MempoConfig
from services.common.messages import TrainingBatch
from services.common.model_io import model_dtype
from services.learner.checkpoint import load_sharded, save_sharded
from services.learner.rendezvous import LOOPBACK, group_store, listen
from services.learner.logprobs import token_logprobs
from services.learner.memory import available_bytes, budget_advice, estimate_peak, fix_mmap_threshold, heap_kept
from services.algorithm.loss import aggregate, behaviour_weights, kl_penalty, policy_loss
from services.learner.noise_scale import GroupGradients
from services.learner.samples import MicroBatch, global_counts, mask_stale, micro_batches
from services.learner.shard import load_model

log = logging.getLogger("mempo.learner")


class LearnerWorker:
    """Built in two calls: the constructor (rank 0 opens the group's rendezvous socket), then ``join``
    on every rank with rank 0's ``store_address()`` (the process group, the model shards, the optimizer).

        w = LearnerWorker(0, 1, config, model_dir); w.join(*w.store_address())     # in-process, W=1
    """

    def __init__(self, rank: int, world: int, config: dict, model_dir: str, store_host: str = LOOPBACK):
        self.cfg = MempoConfig.model_validate(config)
        self.rank, self.world, self.model_dir = rank, world, model_dir
        self.listener = listen(store_host) if rank == 0 else None
        self.address = tuple(self.listener.getsockname()[:2]) if self.listener is not None else None

    def store_address(self) -> tuple[str, int]:
        """(host, port) of rank 0's rendezvous socket: what every rank's ``join`` connects to."""
        if self.address is None:
            raise RuntimeError(f"rank {self.rank} has no rendezvous socket; ask rank 0")
        return self.address

    def join(self, host: str, port: int) -> int:
        """Join the group at rank 0's (host, port), shard the policy (and the reference); returns the pid."""
        from torch.distributed.device_mesh import init_device_mesh  # torch.distributed on use, in the ranks

        rank, world, model_dir = self.rank, self.world, self.model_dir
        lc = self.cfg.learner
        cuda = torch.cuda.is_available()
        backend = lc.backend if lc.backend != "auto" else ("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(0)
        self.store = group_store(rank, world, host, port, self.listener)
        dist.init_process_group(backend, store=self.store, rank=rank, world_size=world)
        self.mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
        dtype = model_dtype(self.cfg.model.dtype)
        torch.manual_seed(self.cfg.train.seed)
        if not cuda:  # Ray pins OMP threads to the actor's CPUs (1 when it asks for less than one)
            torch.set_num_threads(lc.threads or max(1, int(lc.num_cpus_per_worker)))
            fix_mmap_threshold(lc.cpu_mmap_threshold_mib)  # 0: glibc's default, freed activations kept

        device = "cuda" if cuda else "cpu"
        self._check_memory(dtype, device)
        self.lora = lc.lora if lc.lora.rank > 0 else None
        self.model = load_model(model_dir, dtype, self.mesh, device, False, lc.activation_checkpointing, self.lora)
        # the KL term's reference: a frozen copy, or with LoRA the same model with its adapters off
        self.ref = load_model(model_dir, dtype, self.mesh, device, True) if lc.kl_coef > 0 and not self.lora else None
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(self.trainable, lr=lc.lr, weight_decay=lc.weight_decay)
        warm = max(1, lc.warmup_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda s: min(1.0, (s + 1) / warm))
        self.step = 0
        self.skipped_steps = 0  # updates not applied because the loss or the gradient norm was not finite
        return os.getpid()

    def _check_memory(self, dtype: torch.dtype, device: str) -> None:
        """Log the estimated peak of this rank; warn, naming settings that fit, when it exceeds the memory
        available (on CPU without a Ray address every rank shares this machine's)."""
        from transformers import AutoConfig  # transformers on use

        lc = self.cfg.learner
        hf = AutoConfig.from_pretrained(self.model_dir)
        with_ref, kept = lc.kl_coef > 0, heap_kept(lc, device)
        est = estimate_peak(hf, lc, self.world, dtype, with_ref, heap_kept=kept)["total"]
        avail = available_bytes(device) / (self.world if device == "cpu" and not self.cfg.ray.address else 1)
        if self.rank == 0:
            log.info("learner rank 0: estimated peak %.1f GiB at learner.micro_token_budget=%d "
                     "(services/learner/memory.py)", est / 2**30, lc.micro_token_budget)
        advice = budget_advice(hf, lc, self.world, dtype, with_ref, avail, kept)
        if advice:
            log.warning("learner rank %d: %s", self.rank, advice)

    def ready(self) -> int:
        """This rank's process id, once the model is sharded."""
        return os.getpid()

    # -- steps ----------------------------------------------------------------------------------

    def _micro(self, batch: TrainingBatch, by_group: bool = False) -> list[MicroBatch]:
        return micro_batches(batch, self.cfg.learner.micro_token_budget, self.rank, self.world, by_group)

    def _finish_step(self, lr_key: str = "lr", loss: float = 0.0) -> dict:
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.learner.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        lr = self.optim.param_groups[0]["lr"]  # the rate this update uses (set_lr changes it between schedule steps)
        # A non-finite loss (this rank's part) or gradient norm on any rank skips the update on every
        # rank: weights, optimizer state and lr schedule stay as they were; the step is counted.
        bad = torch.tensor(0.0 if math.isfinite(loss) and bool(torch.isfinite(norm)) else 1.0, device=norm.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            self.skipped_steps += 1
        else:
            self.optim.step()
            self.sched.step()
        self.optim.zero_grad(set_to_none=True)
        self.step += 1
        return {"grad_norm": float(norm), lr_key: lr, "skipped_steps": float(self.skipped_steps)}

    def train_step(self, payload: bytes) -> dict:
        """One PPO/GRPO update on the whole batch (gradient accumulation over micro-batches)."""
        lc = self.cfg.learner
        t0 = time.perf_counter()
        batch = decode(payload, TrainingBatch)
        masked = mask_stale(batch) if lc.behaviour_is == "mask" else 0  # before the loss's denominators
        tokens, rows = global_counts(batch)
        micro = self._micro(batch, by_group=lc.noise_scale)
        groups = GroupGradients(self.trainable) if lc.noise_scale else None
        chunk = lc.logit_chunk_tokens
        temp = self.cfg.rollout.temperature if lc.tempered_logprobs and self.cfg.rollout.temperature > 0 else 1.0
        ref = self._reference_logprobs(micro, chunk, temp) if lc.kl_coef > 0 else None
        sums = {"pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "abs_diff": 0.0, "max_abs_diff": 0.0, "tokens": 0.0,
                "clip": 0.0, "dual_clip": 0.0, "lag": 0.0, "lag_max": 0.0, "is_tokens": 0.0, "is_weight": 0.0,
                "is_weight_max": 0.0, "is_truncated": 0.0}
        for i, mb in enumerate(micro):
            lp, ent = token_logprobs(self.model, mb, with_entropy=True, chunk_tokens=chunk, temperature=temp)
            lp = lp.cpu() if lp.device.type != "cpu" else lp
            # One optimizer step per batch: the pre-update policy is the current one, so its log-probs
            # are this forward's, detached (the same numbers a separate no-grad pass would give).
            old = lp.detach()
            mask = mb.loss_mask
            # Decoupled PPO: the ratio is against ``old`` (proximal), the behaviour policy (an older version
            # that sampled stale tokens) enters as a truncated importance weight (services/algorithm/loss.py)
            w, wm = behaviour_weights(old, mb.rollout_logprobs, mb.lag, mask, lc.is_cap, lc.behaviour_is)
            pg, m = policy_loss(lp, old, mb.advantages, mask, lc.clip_eps_low, lc.clip_eps_high, lc.dual_clip_c,
                                lc.loss_agg, tokens, rows, is_weight=w)
            loss = pg
            if ref is not None:
                kl = aggregate(kl_penalty(lp, ref[i], lc.kl_type), mask, lc.loss_agg, tokens, rows)
                loss = loss + lc.kl_coef * kl
                sums["kl"] += float(kl.detach())
            (loss * self.world).backward()  # FSDP averages gradients over ranks; our parts already sum
            if groups is not None and mb.group_end:
                groups.close_group()
            n = float(mask.sum())
            diff = (old - mb.rollout_logprobs).abs() * mask
            sums["pg_loss"] += float(pg.detach())
            sums["entropy"] += float((ent.cpu() * mask).sum())
            sums["abs_diff"] += float(diff.sum())
            sums["max_abs_diff"] = max(sums["max_abs_diff"], float(diff.max()) if n else 0.0)
            sums["tokens"] += n
            sums["clip"] += m["clip_frac"] * n
            sums["dual_clip"] += m["dual_clip_frac"] * n
            sums["lag"] += float((mb.lag * mask).sum())
            sums["lag_max"] = max(sums["lag_max"], float((mb.lag * mask).max()) if n else 0.0)
            sums["is_tokens"] += wm["is_tokens"]
            sums["is_weight"] += wm["is_weight_mean"] * wm["is_tokens"]
            sums["is_truncated"] += wm["is_truncated_share"] * wm["is_tokens"]
            sums["is_weight_max"] = max(sums["is_weight_max"], wm["is_weight_max"] if wm["is_tokens"] else 0.0)
        if groups is not None:
            sums.update(groups.finish())
        sums.update(self._finish_step(loss=sums["pg_loss"] + lc.kl_coef * sums["kl"]))
        sums["masked_stale_tokens"] = float(masked)  # learner.behaviour_is=mask: the whole batch's (every rank's)
        sums["seconds"] = time.perf_counter() - t0
        return sums

    @torch.no_grad()
    def _reference_logprobs(self, micro: list[MicroBatch], chunk: int, temp: float) -> list[torch.Tensor]:
        """Each micro-batch's log-probs under the reference policy (the KL term's): the frozen copy, or
        with LoRA the policy's base (its adapters off)."""
        if self.ref is not None:
            return [token_logprobs(self.ref, mb, chunk_tokens=chunk, temperature=temp)[0].cpu() for mb in micro]
        from services.common.lora import adapters_off  # peft on use

        with adapters_off(self.model):
            return [token_logprobs(self.model, mb, chunk_tokens=chunk, temperature=temp)[0].cpu() for mb in micro]

    def sft_step(self, payload: bytes) -> dict:
        """Cross-entropy on the generated (assistant) tokens; same machinery, same normalisation."""
        t0 = time.perf_counter()
        batch = decode(payload, TrainingBatch)
        tokens, rows = global_counts(batch)
        loss_sum, n = 0.0, 0.0
        for mb in self._micro(batch):
            lp, _ = token_logprobs(self.model, mb, chunk_tokens=self.cfg.learner.logit_chunk_tokens)
            loss = aggregate(-lp.cpu() if lp.device.type != "cpu" else -lp, mb.loss_mask, self.cfg.learner.loss_agg,
                             tokens, rows)
            (loss * self.world).backward()
            loss_sum += float(loss.detach())
            n += float(mb.loss_mask.sum())
        out = {"sft_loss": loss_sum, "tokens": n, **self._finish_step(loss=loss_sum)}
        out["seconds"] = time.perf_counter() - t0
        return out

    def set_lr(self, lr: float) -> None:
        for g in self.optim.param_groups:
            g["lr"] = lr
        self.sched.base_lrs = [lr for _ in self.sched.base_lrs]

    # -- weights --------------------------------------------------------------------------------

    def full_state_dict(self, form: str = "merged") -> dict | None:
        """Collective: every rank must call it; rank 0 gets the CPU state dict in ``model.dtype`` (what vLLM,
        the scorer and exports load; the fp32 masters stay here), others None. With LoRA, ``form`` says
        which: ``merged`` folds the adapters into the base weights (the plain model's keys), ``peft`` holds
        the base and the adapter tensors under peft's keys (for the PEFT export), ``adapter`` the adapter
        tensors only (``learner.lora.publish: adapter``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # on use (see join)

        if form not in ("merged", "peft", "adapter"):
            raise ValueError(f"form must be merged, peft or adapter, got {form!r}")
        if form == "adapter" and self.lora is None:
            raise ValueError("an adapter-only state dict needs learner.lora.rank > 0")
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        if self.lora is not None and form != "peft":
            from services.common.lora import adapter_state, merge_state  # peft on use

            sd = merge_state(sd, self.lora) if form == "merged" else adapter_state(sd)
        dtype = model_dtype(self.cfg.model.dtype)
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}

    def param_digest(self) -> float:
        """A cheap fingerprint of the parameters (sum of |p| over the full model), for tests."""
        total = torch.zeros((), dtype=torch.float64)
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.detach().double().abs().sum().cpu()
        dist.all_reduce(total)
        return float(total)

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, path: str, extra: dict) -> str:
        save_sharded(Path(path), self.model, self.optim, self.sched, self.step, self.rank, extra, self._kept())
        return path

    def _kept(self) -> dict | None:
        """With LoRA, what a checkpoint holds of the model: the adapters (the base is ``model.path``), made
        by these settings, checked on resume."""
        return None if self.lora is None else {"lora": self.lora.model_dump(mode="json")}

    def load_checkpoint(self, path: str) -> dict:
        self.step, extra = load_sharded(Path(path), self.model, self.optim, self.sched, self.rank, self._kept())
        return {"step": self.step, "extra": extra}

    def optimizer_digest(self) -> float:
        """Sum of |state| over every optimizer tensor of the full model, for tests."""
        total = torch.zeros((), dtype=torch.float64)
        for st in self.optim.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    local = v.to_local() if hasattr(v, "to_local") else v
                    total += local.detach().double().abs().sum().cpu()
        dist.all_reduce(total)
        return float(total)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
