"""mlx-lm's affine quantization layout: which bit widths and group sizes it supports.

Codes, scales and biases come from ``mx.quantize`` per token and head vector, so a cut along
the token axis never splits a group.
"""

from ..checks import is_int
from ..errors import CacheConfigError

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)


def check_affine(bits, group_size) -> None:
    if not (is_int(bits) and is_int(group_size)) or bits not in AFFINE_BITS or group_size not in AFFINE_GROUPS:
        raise CacheConfigError(
            f"affine quantization needs bits in {AFFINE_BITS} and group size in "
            f"{AFFINE_GROUPS}; got bits={bits!r}, group={group_size!r}"
        )
