"""Throughput of mempo's msgpack codec on a realistic rollout batch, against pickle.

What it measures
    One MemPO step's TrajectoryBatch at the reference size: 128 prompts x 16 rollouts = 2048
    episodes of about 4 turns (1-7), each turn with a growing int32 context (~300-1500 tokens), a
    ~100-token int32 response with float32 log-probs and a ~150-token int32 observation; each
    episode's full_ids is the concatenation. Built from a seeded numpy RNG, so every run measures
    the same bytes.

    For our codec (``services.common.codec.encode`` / ``decode``, which validate every field) and
    for ``pickle`` protocol 5 of the same dataclass object it reports payload size, encode and
    decode seconds (best of --repeats, gc off during the timed call, as timeit does) and
    throughput = payload MB / seconds (MB = 1e6 bytes), plus the ratio ours/pickle.
    With ``--ray`` it also times a round trip of our bytes through a local Ray object store
    (``ray.put`` + ``ray.get``, and ``put_message`` + ``get_message`` including the codec).

How to run
    .venv/bin/python bench/codec.py                 # codec vs pickle
    .venv/bin/python bench/codec.py --ray           # plus the Ray object store round trip
    .venv/bin/python bench/codec.py --prompts 16    # a smaller batch (quick check)
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import services.common.messages as M  # noqa: E402
from services.common.codec import decode, encode, same, validate  # noqa: E402


def build_batch(prompts: int = 128, n: int = 16, seed: int = 0) -> M.TrajectoryBatch:
    rng = np.random.default_rng(seed)
    groups = []
    for p in range(prompts):
        prompt = M.Prompt(uid=f"train-{p}",
                          messages=[M.ChatMessage("system", "You are a search agent. " * 20),
                                    M.ChatMessage("user", f"Where was person {p} born?; Who founded company {p}?")],
                          golds=[[f"City {p}"], [f"Person {p + 1}"]], extra={"k": 2, "hops": 2})
        episodes = []
        for s in range(n):
            prompt_ids = rng.integers(0, 32000, int(rng.integers(280, 340)), dtype=np.int32)
            history = [prompt_ids]
            n_turns = int(np.clip(rng.poisson(3) + 1, 1, 7))  # mean ~4 turns
            turns = []
            for t in range(n_turns):
                context = np.concatenate(history)[:1500]  # grows ~300 -> 1500 tokens
                resp_len = int(rng.integers(60, 140))
                response = rng.integers(0, 32000, resp_len, dtype=np.int32)
                logprobs = np.log(rng.uniform(1e-3, 1.0, resp_len)).astype(np.float32)
                last = t == n_turns - 1
                obs = np.zeros(0, np.int32) if last else rng.integers(0, 32000, int(rng.integers(120, 180)), dtype=np.int32)
                turns.append(M.TurnRecord(
                    turn=t, context_ids=context, response_ids=response, response_logprobs=logprobs,
                    mem_start=-1 if t == 0 else 0, mem_end=-1 if t == 0 else int(rng.integers(20, 60)),
                    action="answer" if last else "search", action_text=f"query about entity {p} {t}",
                    observation_ids=obs, full_prefix_len=int(sum(len(h) for h in history)), policy_version=3,
                    finish_reason="stop"))
                history += [response, obs]
            episodes.append(M.Episode(uid=f"train-{p}/{s}", sample=s, prompt_ids=prompt_ids,
                                      full_ids=np.concatenate(history), turns=turns, answer=f"City {p}; Person {p + 1}",
                                      finish_reason="answer", tool_calls=n_turns - 1))
        groups.append(M.RolloutGroup(prompt=prompt, episodes=episodes))
    return M.TrajectoryBatch(groups=groups, policy_version=3, step=1, metrics={"rollout/time_s": 12.5})


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        gc_was = gc.isenabled()
        gc.disable()
        try:
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
        finally:
            if gc_was:
                gc.enable()
        best = min(best, dt)
    return best, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=16, help="rollouts per prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray", action="store_true", help="also time a round trip through a local Ray object store")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    batch = build_batch(args.prompts, args.n, args.seed)
    n_eps = sum(len(g.episodes) for g in batch.groups)
    n_turns = sum(len(e.turns) for g in batch.groups for e in g.episodes)
    n_tokens = sum(len(t.context_ids) + len(t.response_ids) + len(t.observation_ids)
                   for g in batch.groups for e in g.episodes for t in e.turns)
    print(f"batch: {args.prompts} prompts x {args.n} rollouts = {n_eps} episodes, {n_turns} turns "
          f"({n_turns / n_eps:.2f}/episode), {n_tokens / 1e6:.1f} M turn tokens; built in {time.perf_counter() - t0:.1f} s")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs, best of {args.repeats}\n")

    enc_s, raw = best_of(lambda: encode(batch), args.repeats)
    dec_s, out = best_of(lambda: decode(raw, M.TrajectoryBatch), args.repeats)
    assert same(out, batch), "codec round trip is not bit-identical"
    val_s, _ = best_of(lambda: validate(batch), args.repeats)

    penc_s, praw = best_of(lambda: pickle.dumps(batch, protocol=5), args.repeats)
    pdec_s, pout = best_of(lambda: pickle.loads(praw), args.repeats)
    assert same(pout, batch), "pickle round trip is not bit-identical"

    rows = [("msgpack codec", len(raw), enc_s, dec_s), ("pickle p5", len(praw), penc_s, pdec_s)]
    print(f"{'format':<14} {'payload MB':>10} {'encode s':>9} {'decode s':>9} {'enc MB/s':>9} {'dec MB/s':>9} {'round-trip MB/s':>16}")
    for name, size, e, d in rows:
        mb = size / 1e6
        print(f"{name:<14} {mb:>10.2f} {e:>9.4f} {d:>9.4f} {mb / e:>9.0f} {mb / d:>9.0f} {mb / (e + d):>16.0f}")
    rt, prt = len(raw) / 1e6 / (enc_s + dec_s), len(praw) / 1e6 / (penc_s + pdec_s)
    print(f"\nratio codec/pickle: round-trip throughput {rt / prt:.2f}x, encode {penc_s / enc_s:.2f}x, "
          f"decode {pdec_s / dec_s:.2f}x faster (>1 = codec faster), payload {len(raw) / len(praw):.3f}x the size")
    print(f"  (of the codec's encode, {val_s:.4f} s is field validation)")

    if args.ray:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray

        from services.common.transport import get_message, put_message

        t0 = time.perf_counter()
        from services.common.local_ray import local_init_options

        ray.init(**local_init_options(num_cpus=1, object_store_memory=max(200_000_000, 4 * len(raw))))
        print(f"\nray {ray.__version__}: local cluster up in {time.perf_counter() - t0:.1f} s")
        try:
            def store_rt():
                ref = ray.put(raw)
                got = ray.get(ref)
                del ref
                return got

            def message_rt():
                ref = put_message(batch)
                got = get_message(ref, M.TrajectoryBatch)
                del ref
                return got

            put_s, ref = best_of(lambda: ray.put(raw), args.repeats)
            get_s, got = best_of(lambda: ray.get(ref), args.repeats)
            assert got == raw
            del ref
            rt_s, got = best_of(store_rt, args.repeats)
            assert got == raw
            msg_s, got = best_of(message_rt, args.repeats)
            assert same(got, batch)
            mb = len(raw) / 1e6
            print(f"{'object store':<30} {'seconds':>9} {'MB/s':>9}")
            for name, s in [("ray.put(bytes)", put_s), ("ray.get(ref)", get_s), ("put + get (one trip)", rt_s),
                            ("put_message + get_message", msg_s)]:
                print(f"{name:<30} {s:>9.4f} {mb / s:>9.0f}")
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
