"""C library functions the writers and readers call through ctypes where Python has no
binding (``sync_file_range``, ``madvise`` on an arbitrary address)."""

import ctypes


def libc_function(name: str, *argtypes):
    """The C library's ``int name(argtypes...)``, or None where this system's C library has
    no such function."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn
