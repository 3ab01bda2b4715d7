"""The options of ``mlxkv serve``: mlx-lm's server options that make sense with mlxkv caches,
plus the cache scheme; and the ones refused, with the reason.

``check_flags(args)`` refuses what cannot be served before anything loads (``mlxkv serve``
exits with status 2); ``mlx_lm_arguments(args)`` turns them into the namespace
``mlx_lm.server`` reads.
"""

import argparse
import json

from ..errors import MLXKVError


class FlagError(MLXKVError):
    """An option of ``mlxkv serve`` that cannot be served (found before the model loads)."""


#: mlx-lm server options mlxkv serve refuses, and why (docs/serving.md)
REFUSED = {
    "kv_bits": "--kv-bits would replace the mlxkv caches by mlx-lm's own QuantizedKVCache (and serve one "
    "request at a time); quantize with the scheme instead: --scheme kv4 (kv4-start5000 quantizes after "
    "5000 tokens, as --quantized-kv-start 5000 would)",
    "kv_group_size": "--kv-group-size belongs to --kv-bits; give the group in the scheme: --scheme kv4-g32",
    "quantized_kv_start": "--quantized-kv-start belongs to --kv-bits; give the start in the scheme: "
    "--scheme kv4-start5000",
    "draft_model": "--draft-model runs speculative decoding on mlx-lm's own caches, one request at a time; "
    "mlxkv serve batches every request on the scheme's caches",
}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", required=True, help="local model directory (or a Hugging Face repo id); required")
    p.add_argument(
        "--scheme",
        default="bf16",
        help="cache scheme of every request: bf16, kv4, turbo-k8v3, ... (`mlxkv schemes` lists them; default: bf16)",
    )
    p.add_argument(
        "--max-kv-size",
        type=int,
        help="full-attention layers become rings of this many positions (default: none, unbounded)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="decode through mlxkv's compiled step (docs/compiled.md); prompts, and batches without a "
        "compiled decode step (eviction rows, rows before their bf16-first start), run eagerly (default: off)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        help="refuse requests whose prompt plus max_tokens exceed this (default: the model's "
        "max_position_embeddings, if its config has one)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080; 0: any free port)")
    p.add_argument(
        "--max-connections",
        type=int,
        default=64,
        help="connections served at once; one more is answered 503 with Retry-After (default: 64)",
    )
    p.add_argument(
        "--adapter-path",
        help="LoRA adapter weights applied to the model (its own store namespace; default: none)",
    )
    p.add_argument(
        "--allowed-origins",
        type=lambda x: [o for o in x.split(",") if o],
        default=[],
        help="comma-separated origins whose web pages may read the answers (CORS), '*' for any "
        "(default: none, no CORS header is sent)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the tokenizer run the model's own code (default: off)",
    )
    p.add_argument(
        "--chat-template",
        default="",
        help="a chat template replacing the tokenizer's (default: the tokenizer's)",
    )
    p.add_argument(
        "--use-default-chat-template",
        action="store_true",
        help="the tokenizer's default template (default: off)",
    )
    p.add_argument(
        "--chat-template-args",
        type=_json_object,
        default="{}",
        help="JSON object of chat-template arguments (default: {})",
    )
    p.add_argument("--temp", type=float, default=0.0, help="default temperature of a request (default: 0, greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="default top_p of a request (default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="default top_k of a request (default: 0, off)")
    p.add_argument("--min-p", type=float, default=0.0, help="default min_p of a request (default: 0, off)")
    p.add_argument("--max-tokens", type=int, default=512, help="default max_tokens of a request (default: 512)")
    p.add_argument("--decode-concurrency", type=int, default=32, help="rows decoded together (default: 32)")
    p.add_argument("--prompt-concurrency", type=int, default=8, help="prompts prefilled together (default: 8)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill step (default: 2048)")
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="prompt-cache entries kept in memory without a store (default: 10)",
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=_parse_size,
        help="byte cap of the prompt cache (e.g. 2GB; default: none, 1GB with --store or --redis)",
    )
    p.add_argument(
        "--store",
        metavar="DIR",
        help="keep prompt caches in an mlxkv PromptStore with this directory as its disk tier "
        "(snapshot files that survive restarts); RAM capped by --prompt-cache-bytes (default: none)",
    )
    p.add_argument(
        "--redis",
        metavar="URL",
        help="share prompt caches through Redis or Valkey (redis://host:6379/0, unix:///path.sock), or a "
        "Redis Cluster (redis+cluster://host:port,host:port), with or without --store (default: none)",
    )
    p.add_argument("--store-disk-bytes", type=_parse_size, help="byte cap of the --store directory (default: none)")
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="(default: INFO)"
    )
    for name in REFUSED:  # accepted by the parser so the refusal can say why
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=argparse.SUPPRESS)
    return p


def _parse_size(text: str) -> int:
    """A byte size as mlx-lm's server reads it (``2GB``, ``512MB``, ``1000``)."""
    from mlx_lm.utils import _parse_size as parse  # mlx-lm (and transformers) only when the option is given

    return parse(text)


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--chat-template-args must be a JSON object")
    return value


def check_flags(args) -> None:
    """Every option ``mlxkv serve`` must refuse, checked before the model loads: options
    that would replace the caches, a scheme (and ``--max-kv-size``) that cannot be built,
    counts that are not positive. Raises :class:`FlagError` saying which and why. (The store's
    options, ``--store`` and ``--redis``, are checked by ``StoreOptions`` when the prompt
    cache is built, before the model loads too.)"""
    from ..caches.schemes import canonical_scheme

    for name, why in REFUSED.items():
        if getattr(args, name, None) is not None:
            raise FlagError(why)
    try:
        canonical_scheme(args.scheme, **cache_options(args))
    except MLXKVError as e:
        raise FlagError(f"--scheme {args.scheme}: {e}") from e
    for flag in (
        "max_context",
        "max_tokens",
        "decode_concurrency",
        "prompt_concurrency",
        "prefill_step_size",
        "max_connections",
    ):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise FlagError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.prompt_cache_size < 0:
        raise FlagError(f"--prompt-cache-size must be at least 0, got {args.prompt_cache_size}")


def cache_options(args) -> dict:
    """``make_cache`` keyword options of the scheme's caches."""
    return {} if args.max_kv_size is None else {"max_kv_size": args.max_kv_size}


def store_scheme(args) -> str:
    """What the prompt store keys its entries on: the canonical form of the scheme with every
    option that changes what the caches hold (``mlxkv.caches.schemes.canonical_scheme``)."""
    from ..caches.schemes import canonical_scheme

    return canonical_scheme(args.scheme, **cache_options(args))


def mlx_lm_arguments(args) -> argparse.Namespace:
    """The namespace ``mlx_lm.server`` reads (its ``cli_args``)."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    return argparse.Namespace(
        model=args.model,
        adapter_path=args.adapter_path,
        draft_model=None,
        num_draft_tokens=3,
        trust_remote_code=args.trust_remote_code,
        chat_template=args.chat_template,
        use_default_chat_template=args.use_default_chat_template,
        chat_template_args=args.chat_template_args,
        pipeline=False,
        allowed_origins=args.allowed_origins,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        decode_concurrency=args.decode_concurrency,
        prompt_concurrency=args.prompt_concurrency,
        prefill_step_size=args.prefill_step_size,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        kv_bits=None,
        kv_group_size=64,
        quantized_kv_start=DEFAULT_QUANTIZED_KV_START,
        log_level=args.log_level,
    )


def parse(argv=None) -> argparse.Namespace:
    """``mlxkv serve``'s options alone (the server module run as a script, the tests)."""
    return add_arguments(argparse.ArgumentParser(prog="mlxkv serve")).parse_args(argv)
