"""A GGUF file's vocabulary as ``tokenizer.json`` and ``tokenizer_config.json``.

A GGUF has no tokenizer file: it lists the tokens, their types (normal, control, user-defined,
byte), merges or scores, the special token ids and the chat template, and llama.cpp applies the
rules of the vocabulary type. The same rules are assembled here from the ``tokenizers``
library's parts (the library mlx-lm and transformers tokenize with):

- ``gpt2`` (SmolLM2): byte-level BPE with the file's merges, after the pre-tokenizer split the
  file's ``tokenizer.ggml.pre`` names (``smollm``: each digit apart, then GPT-2's split);
- ``llama`` (Gemma 3): SentencePiece-style BPE, where the pair whose merged piece has the higher
  score merges first; the file gives scores and no merges, so every split of a normal piece into
  two pieces becomes a merge, ranked by the piece's score. Spaces are ``▁``, no prefix space is
  added where the file says so, and characters outside the vocabulary fall back to byte tokens.

Control tokens become special tokens and user-defined ones (Gemma's ``\\n``, runs of spaces,
HTML tags) added tokens, both matched whole before the model's rules, as llama.cpp does.
(transformers' GGUF converter was evaluated: its reader needs PyTorch, its module is internal
and moves between releases, and it has no ``smollm`` split, so digits would merge.)
"""

import json
from pathlib import Path

from ..errors import ModelError

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def _list(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ModelError(f"the GGUF has no {key!r}: its vocabulary cannot be converted")
        return default
    return f.contents()


def _pre_tokenizer(pre: str):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits = {"smollm": [pre_tokenizers.Digits(individual_digits=True), byte_level], "gpt2": [byte_level]}
    if pre not in splits:
        raise ModelError(f"the GGUF's byte-level vocabulary has pre-tokenizer {pre!r}; converted: {', '.join(splits)}")
    return pre_tokenizers.Sequence(splits[pre])


def _byte_level_bpe(reader, tokens):
    from tokenizers import Tokenizer, decoders, models

    merges = [tuple(m.split(" ", 1)) for m in _list(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(_list(reader, "tokenizer.ggml.pre", "gpt2"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def score_merges(tokens, scores, types) -> list[tuple[str, str]]:
    """Every ``(left, right)`` whose concatenation is a normal piece, both halves pieces, best
    merged piece first (higher score; the file's order on equal scores)."""
    index = {t: i for i, t in enumerate(tokens)}
    ranked = sorted((i for i, t in enumerate(types) if t == NORMAL and len(tokens[i]) > 1), key=lambda i: -scores[i])
    merges = []
    for i in ranked:
        piece = tokens[i]
        merges += [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in index and piece[k:] in index]
    return merges


def _sentencepiece_bpe(reader, tokens, types):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _list(reader, "tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = _list(reader, "tokenizer.ggml.unknown_token_id", -1)
    model = models.BPE(
        vocab=vocab,
        merges=score_merges(tokens, scores, types),
        unk_token=tokens[unk] if unk >= 0 else None,
        byte_fallback=BYTE in types,
        fuse_unk=True,
    )
    tokenizer = Tokenizer(model)
    replace = [normalizers.Replace(" ", "▁")]
    if _list(reader, "tokenizer.ggml.add_space_prefix", True):
        replace.insert(0, normalizers.Prepend("▁"))
    tokenizer.normalizer = normalizers.Sequence(replace)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _special(reader, tokens, key):
    token_id = _list(reader, f"tokenizer.ggml.{key}", -1)
    return tokens[token_id] if 0 <= token_id < len(tokens) else None


def convert_tokenizer(reader, context_length: int):
    """``(tokenizer, tokenizer_config)``: a ``tokenizers.Tokenizer`` following the GGUF's
    vocabulary rules, and the ``tokenizer_config.json`` entries (special tokens, BOS rule,
    chat template)."""
    from tokenizers import AddedToken, processors

    tokens = _list(reader, "tokenizer.ggml.tokens")
    types = _list(reader, "tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    kind = _list(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(reader, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(reader, tokens, types)
    else:
        raise ModelError(f"the GGUF's vocabulary type {kind!r} is not converted (gpt2 and llama are)")
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )
    bos = _special(reader, tokens, "bos_token_id")
    add_bos = bool(_list(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        bos_id = tokens.index(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": _special(reader, tokens, "eos_token_id"),
        "unk_token": _special(reader, tokens, "unknown_token_id"),
        "pad_token": _special(reader, tokens, "padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    if (template := reader.fields.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template.contents()
    return tokenizer, config


def save_tokenizer(reader, context_length: int, directory) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the GGUF into ``directory``."""
    tokenizer, config = convert_tokenizer(reader, context_length)
    directory = Path(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    with open(directory / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
