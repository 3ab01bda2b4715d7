"""The converted tokenizers encode as the GGUF's own vocabulary rules say.

The reference is written here from the GGUF format and llama.cpp's documented tokenizer
behaviour, independently of the converter (which assembles the ``tokenizers`` library's parts):

- both: the text is first cut at special tokens, longest token first across the whole text
  (control tokens, which a chat template writes, and user-defined ones, which are always
  whole); the pieces between are tokenized by the vocabulary type's rule;
- ``gpt2`` (SmolLM2, pre-tokenizer ``smollm``): each digit alone, then GPT-2's split
  (contractions, an optional space and letters, numbers, other symbols, whitespace runs that
  leave the last space to the next word); each piece's UTF-8 bytes spelled in GPT-2's byte
  alphabet; then the adjacent pair of lowest merge rank merges first (leftmost on equal rank);
- ``llama`` (Gemma 3, SentencePiece-style): spaces become ``▁`` (no space prefix: the file says
  so); UTF-8 characters merge, the adjacent pair whose concatenation is a token of the highest
  score first (leftmost on equal score), over every token of the vocabulary; a final symbol that
  is no token is written as its byte tokens ``<0xXX>``; BOS first when the file says to add it.

What this covers: the texts below (ASCII prose, accents, Cyrillic, CJK, emoji and a ZWJ
sequence, runs of spaces, tabs and newlines, digits and numbers, contractions, code, HTML,
chat-template output with its special tokens, special tokens mid-text) and decoding back to the
same text. What it does not: texts unlike these; Unicode categories where the ``regex`` module
and the tokenizers library's engine might disagree (none in these texts); the order of equal-
score merges at overlapping places; llama.cpp's mode that reads special-token text as plain
text; the streaming detokenizer.
"""

import pytest
import regex
from real_models import GEMMA3, SMOLLM2, chat_prompt, gguf, loaded

pytestmark = pytest.mark.real

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; don't panic, I'LL wait!",
    "Ünïcödé: café, naïve, Straße, Ångström; Здравствуй, мир; 東京は日本の首都です。",
    "emoji 😀🎉 and a family 👨‍👩‍👧 with 🇫🇷 flags",
    "two  spaces, five     spaces, seventeen                 and forty                                        end",
    "tabs\tand\t\ttabs\n\nnewlines\n\n\nthree   \n  mixed \r\n",
    "digits 0123456789, 12345, 3.14159, 1,000,000 and -42e-7 or 2024-06-01",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    '<div class="a">hello</div> <b>bold</b> <br/>',
    "   leading spaces and trailing   ",
    "a" * 60 + " " + "ab" * 30,
]


def _fields(name):
    return gguf(name).metadata.get


def _cut_at_specials(text, specials):
    """[(is_special, piece)]: ``text`` cut at every special token, longest tokens first."""
    parts = [(False, text)]
    for token in sorted(specials, key=len, reverse=True):
        cut = []
        for special, piece in parts:
            if special or token not in piece:
                cut.append((special, piece))
                continue
            pieces = piece.split(token)
            for i, p in enumerate(pieces):
                if i:
                    cut.append((True, token))
                if p:
                    cut.append((False, p))
        parts = cut
    return parts


def _gpt2_bytes():
    """GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the others for
    code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


GPT2_SPLIT = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


class ByteLevelBPE:
    def __init__(self, name):
        get = _fields(name)
        assert get("tokenizer.ggml.model") == "gpt2" and get("tokenizer.ggml.pre") == "smollm"
        self.tokens = get("tokenizer.ggml.tokens")
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.rank = {tuple(m.split(" ", 1)): r for r, m in enumerate(get("tokenizer.ggml.merges"))}
        types = get("tokenizer.ggml.token_type")
        self.specials = [t for t, k in zip(self.tokens, types) if k in (CONTROL, USER_DEFINED)]
        self.bytes = _gpt2_bytes()
        assert not get("tokenizer.ggml.add_bos_token", False)

    def _word(self, word):
        symbols = [self.bytes[b] for b in word.encode("utf-8")]
        while True:
            ranked = [(self.rank[p], i) for i, p in enumerate(zip(symbols, symbols[1:])) if p in self.rank]
            if not ranked:
                break
            i = min(ranked)[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        return [self.ids[s] for s in symbols]

    def encode(self, text):
        out = []
        for special, piece in _cut_at_specials(text, self.specials):
            if special:
                out.append(self.ids[piece])
                continue
            for chunk in regex.split(r"(\p{N})", piece):  # each digit alone first
                for word in GPT2_SPLIT.findall(chunk):
                    out += self._word(word)
        return out


class ScoredSentencePiece:
    def __init__(self, name):
        get = _fields(name)
        assert get("tokenizer.ggml.model") == "llama" and not get("tokenizer.ggml.add_space_prefix", True)
        self.tokens = get("tokenizer.ggml.tokens")
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.scores = get("tokenizer.ggml.scores")
        types = get("tokenizer.ggml.token_type")
        self.specials = [t for t, k in zip(self.tokens, types) if k in (CONTROL, USER_DEFINED)]
        self.bos = get("tokenizer.ggml.bos_token_id") if get("tokenizer.ggml.add_bos_token", False) else None

    def _piece(self, text):
        symbols = list(text.replace(" ", "▁"))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                token = self.ids.get(symbols[i] + symbols[i + 1])
                if token is not None and (best is None or self.scores[token] > best[0]):
                    best = (self.scores[token], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        out = []
        for s in symbols:
            out += [self.ids[s]] if s in self.ids else [self.ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
        return out

    def encode(self, text):
        out = [] if self.bos is None else [self.bos]
        for special, piece in _cut_at_specials(text, self.specials):
            out += [self.ids[piece]] if special else self._piece(piece)
        return out


@pytest.fixture(scope="module")
def smollm2():
    return ByteLevelBPE(SMOLLM2), loaded(SMOLLM2)[1]


@pytest.fixture(scope="module")
def gemma3():
    return ScoredSentencePiece(GEMMA3), loaded(GEMMA3)[1]


def _texts(tokenizer, specials):
    chat = tokenizer.decode(chat_prompt(tokenizer, "What is 2+2? Answer briefly.")) if tokenizer.chat_template else None
    return [*TEXTS, *([chat] if chat else []), f"before{specials[0]}after {specials[1]} spaced"]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_the_converted_tokenizer_encodes_as_the_ggufs_rules(model, request):
    reference, tokenizer = request.getfixturevalue(model)
    specials = [t for t in reference.specials if t.startswith("<") and len(t) > 3]
    for text in _texts(tokenizer, specials):
        assert tokenizer.encode(text) == reference.encode(text), text


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_the_converted_tokenizer_decodes_back_to_the_text(model, request):
    reference, tokenizer = request.getfixturevalue(model)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, text


def test_the_chat_template_is_smollm2s_own(smollm2):
    _, tokenizer = smollm2
    text = tokenizer.decode(chat_prompt(tokenizer, "Hi"))
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token_ids == {2}  # <|im_end|> ends the assistant's turn
