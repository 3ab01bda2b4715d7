"""Which container a file is, decided on the one descriptor every later read goes through.

mlxkv reads two containers: safetensors (its own snapshots, mlx-lm's prompt caches) and
mlx-bun's cache files, told apart by their first bytes. ``open_container`` opens the path
once, reads the magic from that descriptor and hands it to the container's
:class:`~mlxkv.io.tensor_file.TensorFile`: a file renamed over the path between the two
can neither be read as the other container nor mixed with the first.
"""

import os

from ..errors import SnapshotError
from .mlxbun import MAGIC, MlxBunFile, is_mlx_bun_magic
from .safetensors import SafetensorsFile
from .tensor_file import TensorFile, open_regular, read_exactly, regular_stat


def open_container(path: str) -> TensorFile:
    """``path`` opened once: an :class:`MlxBunFile` when it starts with mlx-bun's magic
    (either generation), else a :class:`SafetensorsFile`; its header checked. Close it (or
    use ``with``)."""
    fd = open_regular(path)
    try:
        regular_stat(fd, path)
        try:
            head = read_exactly(fd, len(MAGIC), 0)
        except OSError as e:
            raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from e
    except BaseException:
        os.close(fd)
        raise
    return (MlxBunFile if is_mlx_bun_magic(head) else SafetensorsFile)(path, fd)
