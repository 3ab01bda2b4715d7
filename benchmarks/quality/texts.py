"""Real English text for the real-model quality runs, from files every such machine has (no
internet): what is evaluated, what Q-Filters is calibrated on, and a check that the two share
no passage.

- ``pydoc-topics-eval``: the last 10 % of CPython's ``pydoc_data.topics`` (the ``help()``
  topics: English documentation prose with some code), the bytes the toy model holds out;
- ``gpl-3``: the GNU General Public License version 3 (``/usr/share/common-licenses/GPL-3``,
  Debian's ``base-files``), legal prose whose defined terms recur across the whole text;
- calibration: the first 90 % of ``pydoc_data.topics`` (the toy's training split).

Both evaluation texts are public and old, so the pretrained models have likely read them (the
GPL surely): absolute perplexities are low for that reason, and the comparisons between
caches are what the runs report. "Held out" means held out from the Q-Filters calibration.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxkv.models.toy import data

GPL3 = Path("/usr/share/common-licenses/GPL-3")
SHINGLE = 64  # bytes: a passage this long found in both texts counts as shared


@dataclass
class Text:
    name: str
    source: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def record(self, tokens: int) -> dict:
        return {"name": self.name, "source": self.source, "sha256": self.sha256, "tokens": tokens}


def _pydoc_split(split: str) -> str:
    raw = data.corpus_bytes()
    cut = int(len(raw) * data.TRAIN_FRACTION)
    return (raw[:cut] if split == "train" else raw[cut:]).decode("utf-8", errors="ignore")


def evaluation_texts() -> list[Text]:
    if not GPL3.exists():
        raise SystemExit(f"{GPL3} is missing (Debian's base-files ships it): the quality runs read it")
    return [
        Text("pydoc-topics-eval", f"{data.CORPUS_NAME}: the last 10 % of its bytes", _pydoc_split("eval")),
        Text("gpl-3", str(GPL3), GPL3.read_text(encoding="utf-8")),
    ]


def calibration_text() -> Text:
    return Text("pydoc-topics-train", f"{data.CORPUS_NAME}: the first 90 % of its bytes", _pydoc_split("train"))


def _shingles(text: str) -> set:
    b = text.encode("utf-8")
    return {hash(b[i : i + SHINGLE]) for i in range(0, max(len(b) - SHINGLE, 0) + 1, 8)}


def shared_passages(evaluated: Text, calibration: Text) -> float:
    """The share of ``evaluated``'s 64-byte passages (every 8th byte offset) that occur
    verbatim in ``calibration`` (any offset)."""
    cal = calibration.text.encode("utf-8")
    every = {hash(cal[i : i + SHINGLE]) for i in range(len(cal) - SHINGLE + 1)}
    mine = _shingles(evaluated.text)
    return len(mine & every) / max(len(mine), 1)


def calibration_batches(tokenizer, n: int, length: int) -> list[np.ndarray]:
    """``n`` windows of ``length`` tokens at evenly spaced offsets of the calibration text."""
    ids = np.asarray(tokenizer.encode(calibration_text().text), dtype=np.int64)
    if len(ids) < length:
        raise SystemExit(f"the calibration text has {len(ids)} tokens, fewer than {length}")
    starts = np.linspace(0, len(ids) - length, n).astype(np.int64)
    return [ids[s : s + length][None] for s in starts]
