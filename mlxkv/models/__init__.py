"""Models to run the caches on: small seeded models of mlx-lm architectures built in code
(``seeded``), the small trained model the scheme tests measure (``toy``), and the numpy llama
it was trained with (``numpy_llama``)."""
