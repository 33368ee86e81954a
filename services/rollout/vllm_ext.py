"""A vLLM worker extension (``worker_extension_cls``): fixes after an in-place weight reload.

On CPU, vLLM repacks linear weights for its GEMM kernels when a model loads. ``reload_weights``
repacks the layers it reloads, but a *tied* LM head (``lm_head`` = ``embed_tokens``, as in the tiny
model and small Qwen2.5 models) is skipped when loading, so its packed copy keeps the old
embedding and generation silently mixes old and new weights (measured: log-prob error 0.12 after
perturbing only the embedding). ``refresh_tied_head`` re-runs the head's post-load processing
from its (already updated) weight. On GPU that processing is a no-op.

The ``wsync_*`` methods are this engine's end of the learner's weight group (``learner.publish:
collective``; services/common/weight_broadcast.py, services/learner/collective.py): they run in the
engine-core process, so the broadcast lands there directly (no file, no copy through the replica),
is staged whole, and ``wsync_commit`` loads it in place with vLLM's ``reload_weights`` (the same
layer-wise reload and kernel repacking as a reload from a folder), then refreshes a tied head.
vLLM's own weight-transfer engines (``weight_transfer_config``: nccl, ipc, ...) are CUDA-only.
"""

from __future__ import annotations

from services.common.weight_broadcast import Receiver


class WeightSyncExtension:
    def refresh_tied_head(self) -> bool:
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if head is None or method is None or not hasattr(method, "process_weights_after_loading"):
            return False
        method.process_weights_after_loading(head)
        return True

    def _wsync(self):
        if getattr(self, "_wsync_receiver", None) is None:
            self._wsync_receiver = Receiver()
        return self._wsync_receiver

    def wsync_group(self) -> str | None:
        return self._wsync().group_id

    def wsync_join(self, host: str, port: int, world: int, group_id: str, timeout_s: float) -> int:
        return self._wsync().join(host, port, world, group_id, timeout_s)

    def wsync_receive(self, group_id: str, version: int, plan: list, timeout_s: float) -> dict:
        return self._wsync().receive(group_id, version, plan, timeout_s)

    def wsync_commit(self, version: int, names: list[str]) -> bool:
        """Load the staged set of ``version`` (only ``names``: a tied head is not a checkpoint weight)."""
        receiver = self._wsync()
        try:
            tensors = receiver.tensors(version)
            self.reload_weights(weights_iterator=((k, tensors[k]) for k in names))
        finally:
            receiver.drop()
        return self.refresh_tied_head()

    def wsync_drop(self) -> None:
        self._wsync().drop()
