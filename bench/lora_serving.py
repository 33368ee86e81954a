"""LoRA on the replicas: ``learner.lora.publish`` adapter vs merged, in one run.

For each mode one rollout engine (services/rollout/engine.py, vLLM) and one scorer model
(services/scorer/service.py's, peft's layers in adapter mode) are started on the model, then:

* publication: the bytes of the ``WeightUpdate`` message the learner puts in the object store (the
  adapters alone, or the whole merged state dict: what full fine-tuning sends too) and the seconds to
  encode it and to load it in the engine (safetensors + in-place reload, or a PEFT folder + a new
  adapter id) and in the scorer (``load_state_dict``), medians over ``--repeats`` policies;
* rollout: tokens/s of ``--requests`` concurrent sampled requests of ``--tokens`` tokens each on a
  ``--prompt``-token prompt (one engine step serves them all, as the agent loop's turns are served);
* scoring: seconds of one forward of the scorer's model over ``--score-tokens`` tokens.

The adapters are seeded random (A and B non-zero), rank ``--rank`` on every linear layer; the merged
weights are those adapters folded in, so both modes serve the same policy. One mode at a time holds
memory. Medians over ``--repeats``.

    .venv/bin/python bench/lora_serving.py [--model .cache/models/smollm2-135m-instruct-float32]
        [--config deploy/configs/smollm2.yaml] [--rank 16] [--requests 8] [--tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _policies(model_dir: str, lora, repeats: int):
    """``repeats`` (adapters, merged state dict) pairs of seeded random adapters on the model."""
    import torch

    from services.common.lora import adapter_shapes, merge_state
    from services.pipeline.apps import load_hf_state

    shapes = adapter_shapes(model_dir, lora)
    base = load_hf_state(model_dir)
    out = []
    for seed in range(repeats):
        g = torch.Generator().manual_seed(seed)
        adapters = {k: 0.02 * torch.randn(s, generator=g) for k, s in shapes.items()}
        out.append((adapters, merge_state({**base, **adapters}, lora)))
    return out


async def _rollout(engine, args, seed: int) -> float:
    """Tokens/s of ``args.requests`` concurrent sampled requests."""
    from vllm import SamplingParams

    prompt = [(7 * i + 11) % 4000 + 100 for i in range(args.prompt)]
    params = [SamplingParams(temperature=0.7, max_tokens=args.tokens, logprobs=0, seed=seed + i, ignore_eos=True)
              for i in range(args.requests)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(prompt, p) for p in params])
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def _mode(mode: str, args, policies) -> dict:
    import torch

    from services.common.codec import encode
    from services.config import load_config
    from services.common.messages import WeightUpdate
    from services.rollout.engine import PolicyEngine, close_engine
    from services.scorer.service import _load_model

    cfg = load_config(args.config, [f"model.path={args.model}", f"learner.lora.rank={args.rank}",
                                    f"learner.lora.publish={mode}"])
    loop = asyncio.new_event_loop()

    async def start():
        return PolicyEngine(cfg, Path(args.model))

    engine = loop.run_until_complete(start())
    scorer = _load_model(args.model, cfg.model.dtype, cfg.learner.lora if mode == "adapter" else None)
    rows = {"bytes": [], "encode_s": [], "engine_load_s": [], "scorer_load_s": [], "rollout_tok_s": [],
            "score_s": []}
    try:
        loop.run_until_complete(_rollout(engine, args, 0))  # warm-up
        for version, (adapters, merged) in enumerate(policies, start=1):
            tensors = adapters if mode == "adapter" else merged
            t0 = time.perf_counter()
            payload = encode(WeightUpdate(version=version, tensors=tensors))
            rows["encode_s"].append(time.perf_counter() - t0)
            rows["bytes"].append(len(payload))
            rows["engine_load_s"].append(loop.run_until_complete(engine.update_weights(tensors, version)))
            t0 = time.perf_counter()
            scorer.load_state_dict(tensors, strict=False)
            rows["scorer_load_s"].append(time.perf_counter() - t0)
            rows["rollout_tok_s"].append(loop.run_until_complete(_rollout(engine, args, 100 * version)))
            ids = torch.arange(args.score_tokens)[None] % 4000 + 100
            with torch.no_grad():
                t0 = time.perf_counter()
                scorer(ids)
                rows["score_s"].append(time.perf_counter() - t0)
    finally:
        close_engine(engine, loop)
    return {k: statistics.median(v) for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".cache/models/smollm2-135m-instruct-float32")
    ap.add_argument("--config", default="deploy/configs/smollm2.yaml")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--score-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["merged", "adapter"], choices=["merged", "adapter"])
    args = ap.parse_args()

    import torch

    from services.config import load_config

    torch.set_num_threads(int(load_config(args.config).scorer.num_cpus) or 1)
    lora = load_config(args.config, [f"learner.lora.rank={args.rank}"]).learner.lora
    policies = _policies(args.model, lora, args.repeats)
    results = {m: _mode(m, args, policies) for m in args.modes}
    print(f"\n{args.model}, rank {args.rank} all-linear; {args.requests} requests x {args.tokens} tokens, "
          f"prompt {args.prompt}; scorer forward {args.score_tokens} tokens; medians of {args.repeats}")
    print(f"| mode | MB published | encode s | engine load s | scorer load s | rollout tok/s | scorer forward s |")
    print("|---|---|---|---|---|---|---|")
    for m, r in results.items():
        print(f"| {m} | {r['bytes'] / 1e6:.1f} | {r['encode_s']:.2f} | {r['engine_load_s']:.2f} | "
              f"{r['scorer_load_s']:.3f} | {r['rollout_tok_s']:.1f} | {r['score_s']:.2f} |")
    if len(results) == 2:
        a, b = results["adapter"], results["merged"]
        print(f"adapter / merged: bytes {a['bytes'] / b['bytes']:.4f}, engine load {a['engine_load_s'] / b['engine_load_s']:.2f}x, "
              f"rollout tok/s {a['rollout_tok_s'] / b['rollout_tok_s']:.2f}x, scorer forward {a['score_s'] / b['score_s']:.2f}x")


if __name__ == "__main__":
    main()
