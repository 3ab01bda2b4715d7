"""File I/O: the safetensors container (header reader, streaming writer, tensor reader),
checksums and atomic writes. Nothing here knows a cache kind."""
