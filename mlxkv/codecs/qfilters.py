"""``qfilters``: Q-Filters' kept rows, their insertion scores and the filter in force.

Fields offset, budget, nSink, recent, sign (+1/-1), calibTokens, calibrated (JSON bool: the
filter came from calibration). Slots, in order: ``keys`` [B, H, T, D], ``values``
[B, H, T, Dv] (cache dtype), ``positions`` int32 [B, H, T], ``scores`` float32 [B, H, T]
(zeros while the fallback has not frozen its filter), ``filter`` float32 [B, H, D] (a
calibrated filter broadcast over B; absent while the fallback has not frozen). With a
filter, T == min(offset, budget); without, T == offset < calibTokens.
"""

from ..errors import CorruptSnapshotError
from ..families import COUNT, FLAG, SIGN
from . import tova
from .base import Codec, expect_slots
from .tova import check_budget_fields, check_positions, check_rows, has_evicted, slot_dtypes

SLOTS = ("keys", "values", "positions", "scores", "filter")


class QFiltersCodec(Codec):
    persisted = "qfilters"
    fields = {**tova.FIELDS, "recent": COUNT, "sign": SIGN, "calibTokens": COUNT, "calibrated": FLAG}
    slots = SLOTS

    def encode(self, cache):
        fields = {
            "offset": cache.offset,
            "budget": cache.budget,
            "nSink": cache.n_sink,
            "recent": cache.recent,
            "sign": cache.sign,
            "calibTokens": cache.calib_tokens,
            "calibrated": bool(cache.calibrated),
        }
        slots = [
            ("keys", cache.keys),
            ("values", cache.values),
            ("positions", cache.positions),
            ("scores", cache.scores),
        ]
        if cache.filter is not None:
            slots.append(("filter", cache.batch_filter()))
        return fields, slots

    def check(self, entry, shapes):
        check_budget_fields(entry)
        kind = "qfilters entry"
        budget, sink, recent = entry["budget"], entry["nSink"], entry["recent"]
        if sink + recent >= budget or entry["calibTokens"] < 2:
            raise CorruptSnapshotError(
                f"{kind}: recent={recent} sign={entry['sign']} calibTokens={entry['calibTokens']} "
                f"with nSink={sink} budget={budget} is not a configuration mlxkv writes"
            )
        has_filter = "filter" in shapes
        expect_slots(entry, shapes, SLOTS if has_filter else SLOTS[:4])
        dtypes = slot_dtypes(entry)
        check_rows(entry, shapes, dtypes, scored=(("scores", "F32"),))
        B, H, rows, D = shapes["keys"]
        offset = entry["offset"]
        if has_filter:
            if list(shapes["filter"]) != [B, H, D] or dtypes.get("filter") != "F32":
                raise CorruptSnapshotError(
                    f"{kind}: filter is {dtypes.get('filter')} {list(shapes['filter'])}, "
                    f"expected F32 [B, H, D] = {[B, H, D]}"
                )
            if rows != min(offset, budget):
                raise CorruptSnapshotError(
                    f"{kind}: {rows} kept rows, but with a filter Q-Filters keeps min(offset={offset}, budget={budget})"
                )
        else:
            if entry["calibrated"]:
                raise CorruptSnapshotError(f"{kind}: calibrated is true but the filter slot is missing")
            if rows != offset or offset >= entry["calibTokens"]:
                raise CorruptSnapshotError(
                    f"{kind}: no filter yet, so every token must be stored and offset below "
                    f"calibTokens={entry['calibTokens']}; got {rows} rows at offset {offset}"
                )

    def trimmable(self, entry, shapes):
        return not has_evicted(entry, shapes)

    def check_values(self, entry, t):
        check_positions(entry, t["positions"])

    def decode(self, entry, t):
        from ..caches.qfilters import QFiltersKVCache

        self.check_values(entry, t)
        cache = QFiltersKVCache(entry["budget"], entry["nSink"], entry["recent"], entry["sign"], entry["calibTokens"])
        return cache.adopt(
            t["keys"],
            t["values"],
            t["positions"],
            t["scores"],
            entry["offset"],
            filter=t.get("filter"),
            calibrated=entry["calibrated"],
        )

    def geometry(self, entry, shapes):
        return shapes["keys"][1], shapes["keys"][3]
