"""Pure array math: quantization, TurboQuant, bit packing, eviction selections.

Nothing here holds a cache or touches a file; live caches and codecs both build on it.
"""
