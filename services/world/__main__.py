"""Command line of the embedded world.

    python -m services.world build [CONFIG.yaml] [key=value ...] [--force]   build (or reuse) it
    python -m services.world show  [CONFIG.yaml] [key=value ...]             summary + a sample
    python -m services.world path  [CONFIG.yaml] [key=value ...]             print its directory
    python -m services.world lengths [CONFIG.yaml] [key=value ...]          oracle episode tokens per k
                                                                             (services/world/lengths.py)
"""

from __future__ import annotations

import json
import sys

from services.config import ConfigError, load_config
from services.common.paths import world_dir


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("build", "show", "path", "lengths"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    force = "--force" in rest
    rest = [a for a in rest if a != "--force"]
    path = rest.pop(0) if rest and "=" not in rest[0] else None
    try:
        cfg = load_config(path, rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # pandas on use: `mempo --help` imports this module
    from services.world.build import build_world, load_manifest  # pandas

    if cmd == "path":
        print(world_dir(cfg))
        return 0
    out = build_world(cfg, force=force) if cmd == "build" or not world_dir(cfg).exists() else world_dir(cfg)
    manifest = load_manifest(out)
    print(f"world: {out}")
    print(json.dumps({k: manifest[k] for k in ("counts", "oracle_em", "build_s", "timings_s")}, indent=1))
    if cmd == "lengths":
        from services.world.lengths import lengths_table, oracle_lengths  # pandas

        print("\noracle episodes on the held-out prompts (perfect behaviour), tokens:\n")
        print(lengths_table(oracle_lengths(cfg, out), cfg))
    if cmd == "show":
        import pandas as pd  # pandas on use

        test = pd.read_parquet(out / "test.parquet")
        row = test.iloc[len(test) // 2]
        print("\nsample test prompt:", row["prompt"][1]["content"], "->", row["reward_model"]["ground_truth"]["target"])
        with open(out / "oracle.jsonl") as f:
            traj = json.loads(f.readline())
        print(f"\nsample oracle trajectory ({traj['behaviour']}, EM {traj['em']}):")
        for m in traj["messages"][1:]:
            print(f"[{m['role']}]\n{m['content']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
