"""The Q-Filters calibration artifact: one safetensors file per model.

Written with our streaming atomic writer, so it is a plain safetensors file any reader
opens: one float32 tensor ``filters.<layer>`` [H_kv, D] per calibrated layer, and under
``__metadata__["mlxkv.qfilters"]`` a JSON object ``{version, modelId, nLayers, layers,
nSamples, dataset, crc32}`` (``layers``: the calibrated layer indices; ``crc32``: tensor
name -> CRC-32 hex). Safetensors rather than npz: no pickle, a header we can check before
reading a byte of tensor data, and the same reader as our snapshots.

``load_qfilters`` refuses a file whose version it does not know, whose model id is not the
expected one, that is inconsistent with itself (layers outside nLayers, missing or extra
tensors, bad shapes or checksums) and, given ``model=``, whose layer count, calibrated
layers or head layout disagree with that model.
"""

import json

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..caches.qfilters_calibration import CALIBRATION_VERSION, QFiltersCalibration
from ..checks import is_int
from ..errors import (
    CorruptSnapshotError,
    FormatVersionError,
    GeometryMismatchError,
    IdentityMismatchError,
    MLXKVError,
)
from ..io import strict_json
from ..io.safetensors import SafetensorsFile, write_atomic
from ..io.tensor_reader import TensorReader
from ..state.identity import model_geometry

META_KEY = "mlxkv.qfilters"


def _tensor_name(layer: int) -> str:
    return f"filters.{layer}"


def save_qfilters(cal: QFiltersCalibration, path: str, fsync: bool = True) -> dict:
    """Write ``cal`` atomically to ``path``; returns the metadata written."""
    if not cal.model_id:
        raise MLXKVError("save_qfilters: the calibration needs a model_id (loads check it)")
    layers = [i for i, f in enumerate(cal.filters) if f is not None]
    if not layers:
        raise MLXKVError("save_qfilters: the calibration holds no filter")
    tensors = []
    for i in layers:
        f = cal.filters[i]
        if len(f.shape) != 2:
            raise MLXKVError(f"save_qfilters: layer {i} filter must be [H_kv, D], got {list(f.shape)}")
        tensors.append((_tensor_name(i), mx.array(f).astype(mx.float32)))
    meta = {
        "version": cal.version,
        "modelId": cal.model_id,
        "nLayers": len(cal.filters),
        "layers": layers,
        "nSamples": int(cal.n_samples),
        "dataset": cal.dataset,
    }
    written = {}

    def build(crcs):
        written.update(meta, crc32=dict(crcs))
        text = json.dumps(written, separators=(",", ":"), sort_keys=True)
        return {META_KEY: text}

    write_atomic(path, tensors, build, fsync=fsync)
    return written


MAX_LAYERS = 1 << 16  # layers a calibration may declare


def _parse(path: str, st) -> dict:
    text = st.metadata.get(META_KEY)
    if text is None:
        raise CorruptSnapshotError(f"{path}: not a Q-Filters calibration (no {META_KEY!r} metadata)")
    meta = strict_json.loads(text, f"{path}: calibration metadata")
    version = meta.get("version") if isinstance(meta, dict) else None
    if not is_int(version):
        raise CorruptSnapshotError(f"{path}: calibration version missing or not an integer")
    if version != CALIBRATION_VERSION:
        raise FormatVersionError(
            f"{path}: Q-Filters calibration version {version}; this mlxkv reads version "
            f"{CALIBRATION_VERSION}: recalibrate or upgrade mlxkv"
        )
    n, layers, crcs = meta.get("nLayers"), meta.get("layers"), meta.get("crc32")
    if (
        not is_int(n)
        or not 1 <= n <= MAX_LAYERS  # a list of n entries is built from it
        or not isinstance(layers, list)
        or not isinstance(crcs, dict)
        or not all(isinstance(i, int) and 0 <= i < n for i in layers)
        or layers != sorted(set(layers))
    ):
        raise CorruptSnapshotError(f"{path}: calibration metadata lists layers {layers!r} of nLayers={n!r}")
    names = {_tensor_name(i) for i in layers}
    if set(st.tensors) != names or set(crcs) != names:
        raise CorruptSnapshotError(
            f"{path}: calibration declares layers {layers} but holds tensors {sorted(st.tensors)}"
        )
    for name in names:
        info = st.tensors[name]
        if info.dtype != "F32" or len(info.shape) != 2:
            raise CorruptSnapshotError(f"{path}: {name} is {info.dtype} {info.shape}, expected F32 [H_kv, D]")
    return meta


def _check_model(path: str, meta: dict, st, model):
    template = model.make_cache() if hasattr(model, "make_cache") else [mlx_cache.KVCache() for _ in model.layers]
    if meta["nLayers"] != len(template):
        raise GeometryMismatchError(
            f"{path}: calibration covers {meta['nLayers']} layers, the model has {len(template)}: "
            "it was made for another model"
        )
    geo = model_geometry(model)
    for i, t in enumerate(template):
        full_attention = isinstance(t, mlx_cache.KVCache)
        name = _tensor_name(i)
        if full_attention and name not in st.tensors:
            raise GeometryMismatchError(f"{path}: no filter for full-attention layer {i} of the model")
        if name in st.tensors:
            heads, dim = st.tensors[name].shape
            if (geo.kv_heads is not None and heads != geo.kv_heads) or (
                geo.head_dim is not None and dim != geo.head_dim
            ):
                raise GeometryMismatchError(
                    f"{path}: layer {i} filter is [{heads}, {dim}], the model has "
                    f"{geo.kv_heads} kv heads of dim {geo.head_dim}"
                )


def load_qfilters(
    path: str, expect_model_id: str | None = None, model=None, verify: bool = True
) -> QFiltersCalibration:
    """Read a calibration written by :func:`save_qfilters`; everything is checked before a
    tensor is read. ``expect_model_id``: refuse another model's filters. ``model``: refuse a
    calibration whose layer count, calibrated layers or head layout disagree with it."""
    with SafetensorsFile(path) as file:  # one descriptor for the header and the tensors
        st = file.header
        meta = _parse(path, st)
        if expect_model_id is not None and meta.get("modelId") != expect_model_id:
            raise IdentityMismatchError(
                f"{path}: filters were calibrated for {meta.get('modelId')!r}, not {expect_model_id!r}: "
                "filters are model-specific"
            )
        if model is not None:
            _check_model(path, meta, st, model)
        filters = [None] * meta["nLayers"]
        reader = TensorReader(file)
        for i in meta["layers"]:
            name = _tensor_name(i)
            filters[i] = reader.read(name, meta["crc32"][name] if verify else None)
    return QFiltersCalibration(
        filters,
        model_id=meta.get("modelId", ""),
        n_samples=int(meta.get("nSamples", 0)),
        dataset=str(meta.get("dataset", "")),
        version=meta["version"],
    )
