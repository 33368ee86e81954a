"""The ``mempo`` command.

    mempo world build|show|path [CONFIG.yaml] [key=value ...]   the embedded world
    mempo config [CONFIG.yaml] [key=value ...]                  print the resolved config
    mempo config --help-fields                                  every field with its help
    mempo index CORPUS.jsonl OUT_DIR [--backend dense --encoder DIR]  build a retrieval index

Training subcommands (sft, train, eval, serve) arrive with the pipeline.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _index(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mempo index", description="Build a retrieval index from a Search-R1 JSONL corpus.")
    p.add_argument("corpus", help="JSONL file with {\"id\", \"contents\"} rows")
    p.add_argument("out", help="index directory to write")
    p.add_argument("--backend", choices=["bm25", "dense"], default="bm25")
    p.add_argument("--encoder", default="", help="dense: local encoder directory (e5-style, mean pooling)")
    p.add_argument("--passage-prefix", default="passage: ", help="dense: prefix of every passage")
    args = p.parse_args(argv)
    from services.common.jsonl import read_jsonl
    from services.search_tool.backends import build_index
    from services.search_tool.dense_index import TextEncoder

    t0 = time.perf_counter()
    try:
        rows = read_jsonl(args.corpus)
        encoder = TextEncoder(args.encoder, passage_prefix=args.passage_prefix) if args.backend == "dense" else None
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict) or not {"id", "contents"} <= set(r)), None)
    if bad is not None:
        print(f"error: {args.corpus} line {bad + 1}: rows need \"id\" and \"contents\"", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: {args.corpus} holds no passages", file=sys.stderr)
        return 2
    build_index(rows, args.backend, Path(args.out), encoder, show_progress=True)
    print(f"indexed {len(rows)} passages ({args.backend}) into {args.out} in {time.perf_counter() - t0:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "world":
        from services.world.__main__ import main as world_main

        return world_main(rest)
    if cmd == "config":
        from services.common.config import main as config_main

        return config_main(rest)
    if cmd == "index":
        return _index(rest)
    print(f"error: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
