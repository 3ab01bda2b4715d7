"""mlx-lm's own test suite run against mlxkv caches, scheme by scheme (the drop-in campaign).

    python tests/mlx_lm_campaign.py [--schemes bf16 kv4 ...] [--files test_generate.py ...]
                                    [--json results.json] [--hubless] [--keep DIR]

It downloads the sdist of the installed mlx-lm (``pip download --no-binary :all:``) into a
temporary directory, takes only its ``tests/`` from it, and runs pytest on those files once
per *run*:

- ``mlx-lm``: the baseline, mlx-lm's own caches, nothing substituted;
- a scheme (``bf16``, ``kv4``, ``turbo-k8v3``, ...), optionally ``SCHEME:max_kv_size=N``:
  mlxkv caches substituted for mlx-lm's (below);
- a reference, run for each scheme that has one: mlx-lm's own cache of the same kind,
  ``mlx-lm:max_kv_size=N`` (its ``make_prompt_cache`` asked for rings of N rows wherever a
  test gives no size; like mlx-lm, a model with its own ``make_cache`` ignores it) and
  ``mlx-lm:kvB-gG`` (its ``QuantizedKVCache`` in place of each of its ``KVCache``).

Every difference from the baseline is listed with the first line of its error and whether
the reference does the same (then the difference belongs to the kind of cache, not to
mlxkv), and every test's outcome per run goes to the JSON file. The tests are mlx-lm's,
unchanged; nothing of mlx-lm is kept.

What is substituted, at the narrowest place that covers what the tests reach (this module is
also the pytest plugin, loaded with ``-p mlx_lm_campaign``; the run is named by
``MLXKV_CAMPAIGN_RUN``):

- ``mlx_lm.models.cache.make_prompt_cache`` (and every mlx-lm module that imported it by
  name: ``generate``, ``server``, ...) returns ``mlxkv.make_cache(model, scheme,
  max_kv_size=...)``; a test's own ``max_kv_size`` wins over the run's.
- A model's own ``make_cache`` (every mlx-lm model class that defines one) returns the same
  when a test calls it; mlxkv reads the model's original ``make_cache`` as its layer template.
- The names ``KVCache``, ``QuantizedKVCache``, ``RotatingKVCache`` and ``ArraysCache`` in each
  test module construct mlxkv's class of that name (and forward class attributes such as
  ``merge`` to it), while ``isinstance`` against them still asks mlx-lm's class: code written
  for mlx-lm keeps its checks, and a drop-in must pass them. mlx-lm classes mlxkv has no
  equivalent of (``ChunkedKVCache``, ``CacheList``, mlx-lm's batch caches) stay mlx-lm's.

The suite's tests that load ``mlx-community/Qwen1.5-0.5B-Chat-4bit`` from the hub get a
stand-in written in the working directory under that name (``mlx_lm.load`` reads a local
directory first): a 2-layer qwen2 of random 4-bit weights and a byte-level tokenizer with a
ChatML template, built here in code. It makes those tests runnable offline; a test that
needs the real model's weights or the hub itself still fails, in the baseline as in every
run (``--hubless`` adds a baseline run without the stand-in, to count them).

A per-test timeout applies when ``pytest-timeout`` is installed. mlx-lm's test extras
(``requests`` for test_server.py, ``lm-eval``, ``datasets``) are not mlxkv dependencies: a
file whose imports fail is reported as not collected, in every run alike.
"""

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

import pytest

RUN_ENV = "MLXKV_CAMPAIGN_RUN"
TOUCHES_ENV = "MLXKV_CAMPAIGN_TOUCHES"
BASELINE = "mlx-lm"
RING_SIZE = 64
#: the schemes of issue 22's campaign; a ring run is compared with ``mlx-lm:max_kv_size=N``
SCHEMES = (
    "bf16",
    "kv4",
    "kv8-g32",
    "kv4-start16",
    "turbo-k8v3",
    "turbo-k4v2-start256",
    "tova-b128-s4",
    "qfilters-b128-s4-r32",
    f"bf16:max_kv_size={RING_SIZE}",
)
HUB_MODEL = "mlx-community/Qwen1.5-0.5B-Chat-4bit"
SUBSTITUTED = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ArraysCache")


def parse_run(label: str) -> tuple[str, int | None, tuple | None]:
    """``SCHEME[:max_kv_size=N]`` or ``mlx-lm[:max_kv_size=N | :kvB[-gG]]`` -> (scheme or
    ``mlx-lm``, N or None, (bits, group) of mlx-lm's own affine cache or None)."""
    m = re.fullmatch(r"([^:]+)(?::(?:max_kv_size=(\d+)|kv(\d)(?:-g(\d+))?))?", label)
    if not m or (m[3] and m[1] != BASELINE):
        raise SystemExit(f"bad run {label!r}: write SCHEME, SCHEME:max_kv_size=N or mlx-lm:kvB[-gG]")
    return m[1], int(m[2]) if m[2] else None, (int(m[3]), int(m[4] or 64)) if m[3] else None


def reference_for(label: str) -> str | None:
    """The mlx-lm run with mlx-lm's own cache of the same kind as run ``label``: its rings for
    ``max_kv_size``, its ``QuantizedKVCache`` for a plain affine scheme; None when it has none."""
    scheme, size, _ = parse_run(label)
    if scheme == BASELINE:
        return None
    if size is not None:
        return f"{BASELINE}:max_kv_size={size}"
    m = re.fullmatch(r"kv(\d)(?:-g(\d+))?", scheme)
    return f"{BASELINE}:kv{m[1]}-g{m[2] or 64}" if m else None


# --- the plugin: substitution inside the pytest process -------------------------------------


class _Building(threading.local):
    """True while mlxkv builds a model's caches: a nested model ``make_cache`` (a wrapper
    model asking its language model) is then the original, the template mlxkv reads."""

    active = False


_building = _Building()
#: mlxkv caches built (make_cache calls and substituted constructors) so far in this process
_built = [0]


@contextlib.contextmanager
def _while_building():
    outer, _building.active = _building.active, True
    try:
        yield
    finally:
        _building.active = outer


class _SchemeMakeCache:
    """Replaces a model class's ``make_cache``: a call returns the run's mlxkv caches; the
    function carries the model's own bound ``make_cache`` as ``layer_template``."""

    def __init__(self, original, build):
        self.original, self.build = original, build

    def __get__(self, model, owner=None):
        bound = self.original.__get__(model, owner)
        if model is None:
            return bound

        def make_cache():
            return bound() if _building.active else self.build(model, None)

        make_cache.layer_template = bound
        return make_cache


class _Substitute(type):
    """A name that constructs mlxkv's class while ``isinstance`` asks mlx-lm's."""

    def __call__(cls, *args, **kwargs):
        _built[0] += 1
        return cls.mlxkv_class(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.mlx_lm_class)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, cls.mlx_lm_class)

    def __getattr__(cls, name):
        return getattr(cls.mlxkv_class, name)


def _replace_everywhere(original, replacement, name: str):
    """Rebind ``name`` in every loaded mlx-lm module that holds ``original``."""
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("mlx_lm") and getattr(module, name, None) is original:
            setattr(module, name, replacement)


def _import_mlx_lm_users():
    for name in ("mlx_lm.generate", "mlx_lm.server", "mlx_lm.chat", "mlx_lm.evaluate"):
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _model_classes():
    import mlx_lm.models

    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (Exception, SystemExit):  # a model whose optional dependency is missing (olmo exits)
            continue
        for obj in vars(module).values():
            if isinstance(obj, type) and obj.__module__ == module.__name__ and "make_cache" in vars(obj):
                yield obj


def install(label: str):
    """Substitute the caches of run ``label`` in this process (see the module docstring)."""
    from mlx_lm.models import cache as mlx_cache

    scheme, run_size, affine = parse_run(label)
    original = mlx_cache.make_prompt_cache
    _import_mlx_lm_users()
    if scheme == BASELINE:
        if run_size is not None:

            def ring_prompt_cache(model, max_kv_size=None):
                return original(model, run_size if max_kv_size is None else max_kv_size)

            _replace_everywhere(original, ring_prompt_cache, "make_prompt_cache")
        if affine is not None:
            bits, group = affine

            def quantized(model, max_kv_size=None):
                with _while_building():
                    caches = original(model, max_kv_size)
                return [
                    c.to_quantized(group_size=group, bits=bits) if type(c) is mlx_cache.KVCache else c for c in caches
                ]

            _replace_everywhere(original, quantized, "make_prompt_cache")
            for cls in list(_model_classes()):
                cls.make_cache = _SchemeMakeCache(vars(cls)["make_cache"], quantized)
        return

    import mlxkv

    def build(model, max_kv_size=None):
        size = run_size if max_kv_size is None else max_kv_size
        _built[0] += 1
        with _while_building():
            return mlxkv.make_cache(model, scheme, max_kv_size=size)

    _replace_everywhere(original, build, "make_prompt_cache")
    for cls in list(_model_classes()):
        cls.make_cache = _SchemeMakeCache(vars(cls)["make_cache"], build)
    global _substitutes
    _substitutes = {
        name: _Substitute(
            name,
            (),
            {
                "mlxkv_class": getattr(mlxkv, name),
                "mlx_lm_class": getattr(mlx_cache, name),
                "__module__": mlx_cache.__name__,
            },
        )
        for name in SUBSTITUTED
    }


_substitutes: dict = {}


def pytest_configure(config):
    label = os.environ.get(RUN_ENV)
    if label:
        install(label)


def pytest_collection_modifyitems(session, config, items):
    if not _substitutes:
        return
    from mlx_lm.models import cache as mlx_cache

    for module in {id(m): m for m in (i.getparent(pytest.Module) for i in items) if m is not None}.values():
        namespace = vars(module.obj)
        for name, substitute in _substitutes.items():
            if namespace.get(name) is getattr(mlx_cache, name):
                namespace[name] = substitute


_touches: dict = {}
_subtests: dict = {}


def _test_id(nodeid: str) -> str:
    """A pytest node id as its junit report names it: ``tests.test_x.Class::test``."""
    path, *rest = nodeid.split("::")
    module = path[:-3].replace("/", ".")
    return ".".join([module, *rest[:-1]]) + "::" + rest[-1] if rest else module


def _model_overrides(item) -> dict:
    """{attribute: model} for the test class's models (set up once per class) whose
    ``make_cache`` a test has overridden on the instance."""
    cls = getattr(item, "cls", None)
    found = {}
    for name, value in vars(cls).items() if cls is not None else ():
        if isinstance(getattr(value, "__dict__", None), dict) and "make_cache" in vars(value):
            found[name] = value
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Count the mlxkv caches a test builds, and undo a ``self.model.make_cache = ...`` that
    a failing test leaves on its class's shared model (its own last line, ``del
    self.model.make_cache``, is not in a ``finally``): one failure must not fail the tests
    after it."""
    before, overridden = _built[0], _model_overrides(item)
    yield
    _touches[_test_id(item.nodeid)] = _built[0] - before
    for name, model in _model_overrides(item).items():
        if name not in overridden:
            del model.make_cache


def pytest_runtest_logreport(report):
    context = getattr(report, "context", None)  # a subtest's report (self.subTest)
    if context is None or report.when != "call":
        return
    desc = f"[{context.msg}]" if context.msg is not None else ""
    desc += "".join(f"[{k}={v}]" for k, v in context.kwargs.items())
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = (crash.message if crash else str(report.longrepr)).strip().splitlines()[0][:300]
    _subtests[_test_id(report.nodeid) + desc] = (report.outcome, message)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(TOUCHES_ENV)
    if path:
        with open(path, "w") as f:
            json.dump({"built": _touches, "subtests": _subtests}, f)


# --- the stand-in for the hub model -----------------------------------------------------------


def _byte_symbols() -> list[str]:
    """The 256 byte symbols of a byte-level BPE, in its usual order (printable bytes first,
    so token 0 is ``!``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(rest))]


CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def write_standin_model(path: str, seed: int = 0):
    """A small qwen2 with random 4-bit weights and a byte-level ChatML tokenizer at ``path``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    specials = {s: len(symbols) + i for i, s in enumerate(SPECIALS)}
    config = {
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": 320,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "eos_token_id": specials["<|im_end|>"],
        "bos_token_id": None,
    }
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    model.load_weights(
        [
            (n, (mx.ones(p.shape) if "norm" in n else mx.random.normal(p.shape, key=k) * 0.05).astype(mx.bfloat16))
            for (n, p), k in zip(params, keys)
        ]
    )
    model, config = quantize_model(model, config, group_size=64, bits=4)
    os.makedirs(path, exist_ok=True)
    save_model(path, model)
    save_config(config, os.path.join(path, "config.json"))

    tok = Tokenizer(models.BPE(vocab={**vocab, **specials}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    hf.chat_template = CHATML
    hf.save_pretrained(path)


# --- what each difference is ------------------------------------------------------------------

#: The classes of a difference from the baseline (docs/caches.md, "mlx-lm's own tests").
CLASSES = {
    "a": "an mlxkv bug",
    "b": "a refusal or a choice by design (docs/caches.md)",
    "c": "a lossy scheme's expected numeric difference",
    "d": "the test reads how mlx-lm represents something a drop-in need not copy",
    "k": "a point of issue 22 being fixed",
    "s": "mlx-lm's own cache of the kind does the same",
    "?": "not classified yet",
}
A_RING = r":max_kv_size=\d+$"
BF16_FIRST = r"^(kv\d(-g\d+)?-start\d+|turbo-.*)$"
AFFINE = r"^kv\d(-g\d+)?$"
#: (class, why, run pattern, test pattern, message pattern): the first rule that matches all
#: three (``re.search``) classifies a difference, as of mlx-lm 0.32.2 and the mlxkv this was
#: written against; a rule that no longer matches anything is a difference that went away.
# fmt: off
RULES = (
    ("c", "affine: a reused prefix is attended in another kernel than its fresh prefill", AFFINE,
     r"test_handle_completions$", r""),
    ("k", "point 2: an empty affine cache has no nbytes; mlx-lm's server thread dies, the class's later tests fail",
     AFFINE, r"test_server\.TestServer(WithDraftModel)?::", r""),
    ("k", "point 4: mlxkv's ring is not an mlx-lm RotatingKVCache (isinstance, make_cache templates)", r"", r"",
     r"instance of <class 'mlx_lm\.models\.cache\.RotatingKVCache'>|asks for an mlx-lm RotatingKVCache"),
    ("b", "max_kv_size rings a model's own full-attention layers too (mlx-lm ignores it for such a model)", A_RING,
     r"test_pipeline_layer_indices", r"\[True, True\]"),
    ("k", "point 4: mlxkv's ring is not an mlx-lm RotatingKVCache (isinstance)", r"",
     r"test_pipeline_layer_indices", r""),
    ("a", "TurboQuant, TOVA and Q-Filters caches have no keys_and_values() (KV-shared layers call it)", r"", r"",
     r"no attribute 'keys_and_values'"),
    ("b", "a model cache class mlxkv has no equivalent of (CacheList, ChunkedKVCache, LayerCache)", r"", r"",
     r"has no mlxkv equivalent yet|for which mlxkv has no cache yet"),
    ("b", "mlx-lm's kv_bits / to_quantized would swap the cache for mlx-lm's own: refused", r"", r"",
     r"mlx-lm's kv_bits="),
    ("b", "mlx-lm's kv_bits refused inside mlx-lm's server thread", r"", r"test_completion_quantizes_the_cache", r""),
    ("b", "max_kv_size with a scheme that has no ring form", r"", r"", r"has no ring form"),
    ("b", "the scheme cannot encode this head geometry (affine group > head_dim; TurboQuant head_dim, K/V dims)",
     r"", r"", r"divisible by the quantization group size|TurboQuant supports head_dim|TurboQuant appends keys"),
    ("b", "the scheme's cache is not a KVCache (the test asserts bf16's class)", r"", r"",
     r"is not an instance of <class 'mlx_lm\.models\.cache\.KVCache'>"),
    ("b", "mlxkv's batched rings keep the ring's sinks (keep); mlx-lm's BatchRotatingKVCache drops them",
     A_RING, r"test_batch_continued_generation|test_many_batches", r""),
    ("c", "bf16-first: the converting append is attended in bf16, so chunking and reuse change the numbers",
     BF16_FIRST, r"chunked_vs_oneshot|test_many_batches|test_batch_unique_max_toks|test_handle_completions$", r""),
    ("c", "eviction runs after each append: a prefill in chunks keeps other positions than one append",
     r"^(tova|qfilters)-", r"test_batch_continued_generation|test_many_batches|test_batch_unique_max_toks", r""),
)
# fmt: on


def classify(label: str, test: str, message: str, reference: str | None, outcome: str) -> tuple[str, str]:
    """(class, why) of one difference of run ``label``."""
    for cls, why, run, pattern, text in RULES:
        if re.search(run, label) and re.search(pattern, test) and re.search(text, message):
            return cls, why
    if reference == outcome:
        return "s", CLASSES["s"]
    return "?", CLASSES["?"]


# --- the driver ------------------------------------------------------------------------------


def fetch_tests(version: str, into: str) -> str:
    """Download mlx-lm ``version``'s sdist into ``into`` and extract its ``tests/`` only."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"mlx-lm=={version}",
            "-d",
            into,
        ],
        check=True,
    )
    (sdist,) = [f for f in os.listdir(into) if f.endswith(".tar.gz")]
    root = os.path.join(into, "run")
    with tarfile.open(os.path.join(into, sdist)) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.split("/")[1:2] == ["tests"]]
        for m in members:
            m.name = "/".join(m.name.split("/")[1:])
        tar.extractall(root, members=members, filter="data")
    return root


def outcomes(junit: str) -> dict:
    """{test id: (outcome, first line of its message)} from a junit XML file."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}".lstrip(":")
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                text = (child.get("message") or child.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        # a test that failed and then errored in teardown is reported twice: keep the worst
        if test not in result or result[test][0] == "passed":
            result[test] = (outcome, message)
    return result


def run_once(root: str, label: str, files: list, timeout: int, standin: bool) -> dict:
    junit = os.path.join(root, f"junit-{re.sub(r'[^A-Za-z0-9]+', '_', label)}.xml")
    hub = os.path.join(root, *HUB_MODEL.split("/"))
    hub_away = hub + ".away"
    if not standin and os.path.isdir(hub):
        os.rename(hub, hub_away)
    if standin and os.path.isdir(hub_away):
        os.rename(hub_away, hub)
    touches = os.path.join(root, os.path.basename(junit)[:-4] + ".touches.json")
    env = {
        **os.environ,
        RUN_ENV: label,
        TOUCHES_ENV: touches,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *files,
        "-p",
        "no:cacheprovider",
        "-p",
        "mlx_lm_campaign",
        "-o",
        "addopts=",
        "-q",
        "--continue-on-collection-errors",
        f"--junitxml={junit}",
    ]
    if importlib.util.find_spec("pytest_timeout"):
        cmd.append(f"--timeout={timeout}")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    log = os.path.join(root, os.path.basename(junit)[:-4] + ".log")
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    if not os.path.exists(junit):
        raise SystemExit(f"run {label}: pytest wrote no report (exit {proc.returncode}); see {log}")
    seconds = time.monotonic() - t0
    print(f"  {label}: {seconds:.0f} s, pytest exit {proc.returncode}", file=sys.stderr)
    side = {"built": {}, "subtests": {}}
    if os.path.exists(touches):
        with open(touches) as f:
            side = json.load(f)
    result = outcomes(junit)
    result.update({t: tuple(o) for t, o in side["subtests"].items()})
    return {"outcomes": result, "seconds": round(seconds, 1), "log": log, "built": side["built"]}


def counts(result: dict) -> dict:
    """Outcomes of tests, and of subtests (``test[...]``) as ``sub-<outcome>``."""
    c = {}
    for test, (outcome, _) in result.items():
        key = f"sub-{outcome}" if test.endswith("]") else outcome
        c[key] = c.get(key, 0) + 1
    return c


def differences(runs: dict) -> dict:
    """{run: {test: (baseline outcome, outcome, message, reference outcome, class, why)}} for
    every test whose outcome differs from the baseline's; the reference outcome is that of
    mlx-lm's own cache of the same kind (``reference_for``), None when it did not run."""
    base = runs[BASELINE]["outcomes"]
    out = {}
    for label, run in runs.items():
        if parse_run(label)[0] == BASELINE:
            continue
        ref = runs.get(reference_for(label) or "", {}).get("outcomes")
        diff = {}
        for test in sorted(set(base) | set(run["outcomes"])):
            b = base.get(test, ("absent", ""))
            r = run["outcomes"].get(test, ("absent", ""))
            if b[0] != r[0]:
                message, reference = r[1] or b[1], None if ref is None else ref.get(test, ("absent",))[0]
                diff[test] = (b[0], r[0], message, reference, *classify(label, test, message, reference, r[0]))
        out[label] = diff
    return out


SHORT = {"passed": "P", "failed": "F", "error": "E", "skipped": "S", "absent": "-"}


def report(runs: dict, diffs: dict):
    print("\n## Outcomes per run (each compared with the mlx-lm baseline)\n")
    head = ("run", "passed", "failed", "error", "skipped", "subtests passed", "subtests failed", "differs")
    print("| " + " | ".join(head) + " | of which mlx-lm's own cache does the same |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, run in runs.items():
        c = counts(run["outcomes"])
        cells = " | ".join(
            str(c.get(k, 0)) for k in ("passed", "failed", "error", "skipped", "sub-passed", "sub-failed")
        )
        diff = diffs.get(label)
        n = "" if diff is None else len(diff)
        ref = reference_for(label)
        shared = "" if diff is None or ref not in runs else f"{sum(d[3] == d[1] for d in diff.values())} ({ref})"
        print(f"| {label} | {cells} | {n} | {shared} |")
    tests = sorted({t for d in diffs.values() for t in d})
    if not tests:
        print("\nNo run differs from the baseline.")
        return
    labels = list(diffs)
    print("\n## Tests that differ from the baseline\n")
    print("P passed, F failed, E error, S skipped, - not run; a star: mlx-lm's own cache of the kind does the same.\n")
    print("| test | baseline | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for t in tests:
        cells = []
        for lab in labels:
            outcome = runs[lab]["outcomes"].get(t, ("absent", ""))[0]
            d = diffs[lab].get(t)
            cells.append(SHORT[outcome] + ("*" if d and d[3] == d[1] else "") if d else "")
        print(f"| {t} | {SHORT[runs[BASELINE]['outcomes'].get(t, ('absent', ''))[0]]} | " + " | ".join(cells) + " |")
    print("\n## Differences per class\n")
    print("| run | " + " | ".join(f"({c}) {CLASSES[c]}" for c in CLASSES) + " |")
    print("|---|" + "---|" * len(CLASSES))
    for label in labels:
        n = [sum(d[4] == c for d in diffs[label].values()) for c in CLASSES]
        print(f"| {label} | " + " | ".join(map(str, n)) + " |")
    whys = sorted({(d[4], d[5]) for diff in diffs.values() for d in diff.values()})
    print("\n## Why, per class (differences per run)\n")
    for cls, why in whys:
        per = {lab: sum((d[4], d[5]) == (cls, why) for d in diffs[lab].values()) for lab in labels}
        print(f"- ({cls}) {why}: " + ", ".join(f"{lab} {n}" for lab, n in per.items() if n))
    unused = [why for _, why, *_ in RULES if why not in {w for _, w in whys}]
    if unused:
        print("\nRules that matched nothing in this campaign (fixed, or not run):\n")
        print("\n".join(f"- {why}" for why in unused))
    print("\n## First error line of each difference\n")
    for label in labels:
        for t, (b, r, message, ref, cls, _) in diffs[label].items():
            same = f" (mlx-lm's own {reference_for(label)}: {ref})" if ref is not None else ""
            print(f"- ({cls}) {label} {t}: {b} -> {r}{same}: {message}")


def main(argv=None):
    import mlx_lm

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), help="runs besides the baselines")
    ap.add_argument("--files", nargs="+", default=None, help="test files of mlx-lm's tests/ (default: all)")
    ap.add_argument("--json", default="mlx_lm_campaign.json", help="where the per-test outcomes go")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per test (with pytest-timeout)")
    ap.add_argument("--hubless", action="store_true", help="also run the baseline without the stand-in model")
    ap.add_argument("--keep", default=None, help="work in this directory and keep it (default: a temporary one)")
    ap.add_argument("--report", metavar="JSON", help="print the report of a saved campaign again, classified anew")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)["runs"]
        runs = {lab: {"outcomes": {t: tuple(o) for t, o in r["outcomes"].items()}} for lab, r in saved.items()}
        report(runs, differences(runs))
        return

    for label in args.schemes:
        parse_run(label)  # a bad label fails before anything is downloaded
    version = mlx_lm.__version__
    with contextlib.ExitStack() as stack:
        work = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="mlx-lm-campaign-"))
        os.makedirs(work, exist_ok=True)
        print(f"mlx-lm {version}: fetching its tests into {work}", file=sys.stderr)
        root = fetch_tests(version, work)
        write_standin_model(os.path.join(root, *HUB_MODEL.split("/")))
        files = [os.path.join("tests", f) for f in args.files] if args.files else ["tests"]
        labels = [BASELINE]
        labels += sorted({r for r in map(reference_for, args.schemes) if r is not None})
        labels += [s for s in args.schemes if s not in labels]
        runs = {}
        if args.hubless:
            runs[f"{BASELINE} (no stand-in)"] = run_once(root, BASELINE, files, args.timeout, standin=False)
        for label in labels:
            runs[label] = run_once(root, label, files, args.timeout, standin=True)
        hubless = runs.pop(f"{BASELINE} (no stand-in)", None)
        diffs = differences(runs)
        report(runs, diffs)
        if hubless is not None:
            need_hub = [
                t
                for t, (o, _) in hubless["outcomes"].items()
                if o in ("failed", "error") and runs[BASELINE]["outcomes"].get(t, ("",))[0] == "passed"
            ]
            print(f"\nWithout the stand-in, {len(need_hub)} tests that pass with it fail (they need the hub).")
        doc = {
            "mlx_lm": version,
            "files": args.files or "all",
            "runs": {
                lab: {
                    "seconds": r["seconds"],
                    "counts": counts(r["outcomes"]),
                    "outcomes": {t: list(o) for t, o in r["outcomes"].items()},
                    "mlxkv_caches_built": r["built"],
                }
                for lab, r in runs.items()
            },
            "differences": {lab: {t: list(d) for t, d in diff.items()} for lab, diff in diffs.items()},
        }
        if hubless is not None:
            doc["hubless_baseline"] = {t: list(o) for t, o in hubless["outcomes"].items()}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nper-test outcomes: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
