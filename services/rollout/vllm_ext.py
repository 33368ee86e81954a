"""A vLLM worker extension (``worker_extension_cls``): fixes after an in-place weight reload.

On CPU, vLLM repacks linear weights for its GEMM kernels when a model loads. ``reload_weights``
repacks the layers it reloads, but a *tied* LM head (``lm_head`` = ``embed_tokens``, as in the tiny
model and small Qwen2.5 models) is skipped when loading, so its packed copy keeps the old
embedding and generation silently mixes old and new weights (measured: log-prob error 0.12 after
perturbing only the embedding). ``refresh_tied_head`` re-runs the head's post-load processing
from its (already updated) weight. On GPU that processing is a no-op.
"""

from __future__ import annotations


class WeightSyncExtension:
    def refresh_tied_head(self) -> bool:
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if head is None or method is None or not hasattr(method, "process_weights_after_loading"):
            return False
        method.process_weights_after_loading(head)
        return True
