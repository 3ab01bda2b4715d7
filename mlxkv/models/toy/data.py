"""The toy model's data: byte tokens of an offline corpus, plus an associative-recall task.

Corpus: the English documentation text of the CPython standard library's ``pydoc_data.topics``
(the help() topics; present in every CPython install), topics joined in sorted order, UTF-8
bytes. The first 90 % of the bytes are for training, the last 10 % for evaluation.

Tokens: bytes are ids 0-255; ``BOS``, ``PAIR`` and ``ASK`` are 256-258; the vocabulary is
padded to 264.

Recall: ``PAIR K1 K2 v1 v2 v3`` defines a pair: a key of ``KEY_LEN`` random uppercase letters
(distinct within a sequence; uppercase pairs are rare in the corpus) and a value of
``VALUE_LEN`` random lowercase letters. ``ASK K1 K2`` asks for the value of a key defined
earlier, and the next ``VALUE_LEN`` tokens are the answer.
"""

import hashlib
from dataclasses import dataclass

import numpy as np

BOS, PAIR, ASK = 256, 257, 258
VOCAB = 264
KEY_LEN = 2
VALUE_LEN = 3
KEY_ALPHABET = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8).astype(np.int64)
ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8).astype(np.int64)
PROMPT_LEN = 1 + KEY_LEN  # PAIR/ASK, key
ITEM_LEN = PROMPT_LEN + VALUE_LEN
TRAIN_FRACTION = 0.9
CORPUS_NAME = "pydoc_data.topics (CPython standard library help() topics), sorted by topic, UTF-8"


def corpus_bytes() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def corpus_sha256() -> str:
    return hashlib.sha256(corpus_bytes()).hexdigest()


def corpus_split(split: str) -> np.ndarray:
    """``"train"`` or ``"eval"`` byte tokens (int64)."""
    data = np.frombuffer(corpus_bytes(), dtype=np.uint8).astype(np.int64)
    cut = int(len(data) * TRAIN_FRACTION)
    if split == "train":
        return data[:cut]
    if split == "eval":
        return data[cut:]
    raise ValueError(f"split must be 'train' or 'eval', not {split!r}")


@dataclass
class RecallBatch:
    """Recall sequences of one layout: ``tokens`` [B, L]; the defined pairs
    ``keys`` [B, P, KEY_LEN] and ``values`` [B, P, VALUE_LEN]; ``prefix`` tokens come before
    the first query; query ``q`` asks for pair ``order[:, q]`` and starts at
    ``prefix + q * ITEM_LEN``."""

    tokens: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    order: np.ndarray
    prefix: int

    @property
    def n_queries(self) -> int:
        return self.order.shape[1]


def _pairs(rng: np.random.Generator, n: int):
    """n distinct keys [n, KEY_LEN] and n values [n, VALUE_LEN], as letter tokens."""
    base = len(KEY_ALPHABET)
    codes = rng.choice(base**KEY_LEN, size=n, replace=False)
    digits = (codes[:, None] // base ** np.arange(KEY_LEN - 1, -1, -1)) % base
    values = ALPHABET[rng.integers(0, len(ALPHABET), size=(n, VALUE_LEN))]
    return KEY_ALPHABET[digits], values


def _item(head: int, key: np.ndarray, value: np.ndarray) -> np.ndarray:
    return np.concatenate([[head], key, value])


def recall_batch(seed: int, batch: int, length: int, n_pairs: int, text: np.ndarray) -> RecallBatch:
    """Evaluation layout: ``BOS``, ``n_pairs`` definitions, corpus text, then one query per
    pair (in a random order) at the very end; every sequence is exactly ``length`` tokens."""
    rng = np.random.default_rng(seed)
    filler = length - 1 - 2 * n_pairs * ITEM_LEN
    if filler < 0:
        raise ValueError(f"length {length} cannot hold {n_pairs} definitions and queries")
    rows, keys, values, orders = [], [], [], []
    for _ in range(batch):
        k, v = _pairs(rng, n_pairs)
        order = rng.permutation(n_pairs)
        start = int(rng.integers(0, len(text) - filler))
        parts = [[BOS]] + [_item(PAIR, k[i], v[i]) for i in range(n_pairs)] + [text[start : start + filler]]
        parts += [_item(ASK, k[i], v[i]) for i in order]
        rows.append(np.concatenate(parts))
        keys.append(k), values.append(v), orders.append(order)
    return RecallBatch(
        np.stack(rows), np.stack(keys), np.stack(values), np.stack(orders), 1 + n_pairs * ITEM_LEN + filler
    )


def recall_accuracy(model, caches, batch: RecallBatch, chunk: int) -> tuple[float, float]:
    """(per-token, exact) teacher-forced top-1 accuracy of ``model`` on the batch's answers.

    The context before the first query is prefilled in chunks; then each query with its
    answer (``ASK K1 K2 v1 v2 v3``) is one block through the cache, and the arg-max after
    ``K2``, ``v1`` and ``v2`` is compared with ``v1``, ``v2``, ``v3``. Per-token: the fraction
    of answer letters right; exact: the fraction of queries with all three right."""
    import mlx.core as mx

    tokens = mx.array(batch.tokens)
    for i in range(0, batch.prefix, chunk):
        model(tokens[:, i : min(i + chunk, batch.prefix)], cache=caches)
        mx.eval([c.state for c in caches])
    hits = []
    for q in range(batch.n_queries):
        start = batch.prefix + q * ITEM_LEN
        block = tokens[:, start : start + ITEM_LEN]
        pred = mx.argmax(model(block, cache=caches)[:, PROMPT_LEN - 1 : -1], axis=-1)
        hits.append(np.array(pred == block[:, PROMPT_LEN:]))
    hits = np.stack(hits, axis=1)  # [B, Q, VALUE_LEN]
    return float(hits.mean()), float(hits.all(axis=-1).mean())


def text_batch(batch: int, length: int, text: np.ndarray) -> np.ndarray:
    """``batch`` sequences of ``BOS`` plus ``length - 1`` corpus tokens, at evenly spaced
    offsets of ``text`` (deterministic: no seed)."""
    n = length - 1
    if len(text) < n:
        raise ValueError(f"the text has {len(text)} tokens, fewer than {n}")
    starts = np.linspace(0, len(text) - n, batch).astype(np.int64)
    return np.stack([np.concatenate([[BOS], text[s : s + n]]) for s in starts])


# -- training sequences ---------------------------------------------------------------------

RECALL_WEIGHT = 4.0  # loss weight of an answer token, against 1 for a corpus token


def training_sequence(rng: np.random.Generator, length: int, text: np.ndarray, max_pairs: int = 24):
    """One training sequence of ``length + 1`` tokens and the loss weight of each target
    (``length`` weights: weight i belongs to predicting token i + 1).

    A fifth are plain corpus text. The rest define 4..max_pairs pairs after ``BOS``, then
    mix corpus text with queries: in half of them all queries come at the end (the
    evaluation layout), in the other half they are scattered through the text, so every
    distance up to ``length`` is trained. Random tokens (keys, defined values) get weight 0.
    """
    n = length + 1
    if rng.random() < 0.2:
        start = int(rng.integers(0, len(text) - n))
        tokens = np.concatenate([[BOS], text[start : start + n - 1]])
        return tokens, np.ones(length, dtype=np.float32)
    max_pairs = min(max_pairs, (length - 32) // (2 * ITEM_LEN))
    n_pairs = int(rng.integers(4, max_pairs + 1))
    n_queries = int(rng.integers(max(1, n_pairs // 2), n_pairs + 1))
    k, v = _pairs(rng, n_pairs)
    asked = rng.permutation(n_pairs)[:n_queries]
    filler = n - 1 - (n_pairs + n_queries) * ITEM_LEN
    start = int(rng.integers(0, len(text) - filler))
    body = text[start : start + filler]
    if rng.random() < 0.5:
        cuts = np.full(n_queries, filler)
    else:
        cuts = np.sort(rng.integers(0, filler + 1, size=n_queries))
    parts, weights, prev = [[BOS]], [[0.0]], 0
    for i in range(n_pairs):
        parts.append(_item(PAIR, k[i], v[i]))
        weights.append(np.zeros(ITEM_LEN))
    for cut, i in zip(cuts, asked):
        parts.append(body[prev:cut])
        weights.append(np.ones(cut - prev))
        parts.append(_item(ASK, k[i], v[i]))
        weights.append(np.r_[np.zeros(PROMPT_LEN), np.full(VALUE_LEN, RECALL_WEIGHT)])
        prev = cut
    parts.append(body[prev:])
    weights.append(np.ones(filler - prev))
    tokens = np.concatenate(parts).astype(np.int64)
    w = np.concatenate(weights).astype(np.float32)  # w[j]: weight of token j as a target
    return tokens, w[1:]


def training_batch(rng: np.random.Generator, batch: int, length: int, text: np.ndarray):
    """(inputs [B, length], targets [B, length], weights [B, length])."""
    seqs = [training_sequence(rng, length, text) for _ in range(batch)]
    tokens = np.stack([s[0] for s in seqs])
    weights = np.stack([s[1] for s in seqs])
    return tokens[:, :-1], tokens[:, 1:], weights
