"""The small commands: ``inspect`` (a snapshot's header), ``verify`` (every checksum),
``convert`` (mlx-lm prompt-cache files and snapshots between formats), ``schemes`` (the
valid cache schemes), ``fetch-model`` (a real model as an mlx-lm directory) and ``serve``
(mlx-lm's server on mlxkv caches)."""

import os
import sys

from .output import Progress, layers_by_kind, print_table


def cmd_inspect(args) -> int:
    from ..formats.table import describe

    general, headers, rows = describe(args.file)  # one file, however the path is renamed over
    width = max(len(k) for k, _ in general)
    for k, v in general:
        print(f"{k.ljust(width)}  {v}")
    print()
    print_table(headers, rows, out=sys.stdout)
    return 0


def cmd_verify(args) -> int:
    from ..formats.table import verify

    size = os.path.getsize(args.file) if os.path.exists(args.file) else 0
    header = verify(args.file, progress=Progress("verifying"))
    n = sum(len(e["tensors"]) for e in header["caches"])
    fmt = f"mlx-bun format v{header['formatVersion']}, " if header.get("codecProvider") == "mlx-bun" else ""
    print(f"ok: {args.file}: {fmt}{n} tensors in {len(header['caches'])} layers, {size} bytes, every checksum matches")
    return 0


def cmd_convert(args) -> int:
    from ..formats.mlxlm import parse_tokens
    from ..formats.table import convert, format_for
    from ..state.identity import RECORDED

    tokens = parse_tokens(args.tokens) if args.tokens is not None else None
    identity = {k: getattr(args, k) for k in RECORDED if getattr(args, k) is not None}
    to = format_for(args.dst, args.to)
    header = convert(args.src, args.dst, to=to, tokens=tokens, progress=Progress("writing"), **identity)
    kinds = [e["kind"] for e in header["caches"]]
    print(
        f"wrote {args.dst} ({to}): {len(kinds)} layers ({layers_by_kind(kinds)}), "
        f"{len(header['tokens'])} tokens, {os.path.getsize(args.dst)} bytes"
    )
    return 0


def cmd_schemes(args) -> int:
    from ..caches.schemes import scheme_grammar

    print("Cache schemes (mlxkv.make_cache(model, SCHEME), mlxkv serve --scheme SCHEME):")
    for grammar, example in scheme_grammar():
        print(f"  {grammar.ljust(36)}  e.g. {example}")
    print("Any scheme with --max-kv-size N / max_kv_size=N: full-attention layers become rings of N positions")
    print("(schemes without a ring form refuse it). What each costs: docs/choosing-a-scheme.md")
    return 0


def cmd_fetch_model(args) -> int:
    import logging

    from ..models import fetch

    logging.basicConfig(level=logging.INFO, format="mlxkv fetch-model: %(message)s", stream=sys.stderr)
    print(fetch(args.name, out=args.out, dtype=args.dtype))
    return 0


def cmd_serve(args) -> int:
    from ..serve.command import run

    return run(args)
