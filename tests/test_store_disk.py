"""The prompt store's disk tier: an index rebuilt from headers only, files of other identities
and newer formats kept, damaged ones quarantined, dead temporary files deleted, a bounded
write queue, flush reports, generation checkpoints. ``test_regression_*``: behaviour mlx-bun's
SSD tier had to fix (docs/store.md)."""

import os
import shutil
import stat
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from helpers import data_start, flip_bit, rewrite_header
from store_helpers import build, continuation, forward

from mlxkv import MLXKVError, PromptStore, Sampler, Session, StoreTrustError, request_key
from mlxkv.formats.mlxkv_header import FORMAT_VERSION
from mlxkv.models.seeded import prompt, tokenizer

CAP = 64 << 20
PER_TOKEN = 4 * 2 * 2 * 64 * 2  # seeded llama, bf16


def _open(model, d, **kw):
    return PromptStore(model, tokenizer(), cap=kw.pop("cap", CAP), directory=str(d), **kw)


def _files(store):
    root = store._disk.root
    return sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))


def _put(store, model, tokens, scheme="bf16", opts=None, chunk=64, **kw):
    store.put(tokens, build(model, scheme, opts or {}, tokens, chunk), **kw)


def test_reopen_serves_every_flushed_entry(models, tmp_path):
    model = models("llama")
    a, b = prompt(40, seed=1), prompt(50, seed=2)
    with _open(model, tmp_path) as s:
        _put(s, model, a)
        _put(s, model, b)
        report = s.flush()
        assert sorted(len(t) for _, t in report.durable) == [40, 50] and report.ok
    with _open(model, tmp_path) as s:
        assert s.opened.indexed == 2 and len(s) == 0  # nothing in RAM until taken
        more = prompt(5, seed=7)
        hit = s.take(a + more)
        assert hit.tier == "disk" and hit.prefix_len == 40
        np.testing.assert_array_equal(
            continuation(model, hit.caches, more), continuation(model, build(model, "bf16", {}, a, 64), more)
        )
        assert s.take(a + more).tier == "ram"  # promoted


def test_regression_open_reads_headers_only_and_a_damaged_tensor_is_a_miss(models, tmp_path):
    """Opening reads no tensor byte (a flipped tensor bit goes unnoticed until a take, whose
    checksum catches it: the file is quarantined and the take falls back); mlx-bun deleted a
    file on any restore failure, mlxkv keeps it for inspection."""
    model = models("llama")
    a = prompt(40, seed=1)
    with _open(model, tmp_path) as s:
        _put(s, model, a[:30], pin=True)  # pinned: the longer entry does not supersede it
        _put(s, model, a)
        s.flush()
        (path,) = [s._disk.path_of(e.key) for e in s._disk.entries() if len(e.tokens) == 40]
    flip_bit(path, data_start(path) + 100)
    with _open(model, tmp_path) as s:
        assert s.opened.indexed == 2 and not s.opened.quarantined
        hit = s.take(a + [1])
        assert hit.prefix_len == 30 and hit.tier == "disk"  # the damaged 40-token entry was skipped
        assert os.path.exists(os.path.join(s._disk.root, "quarantine", os.path.basename(path)))
        assert not os.path.exists(path) and len(s._disk) == 1


def test_regression_other_identities_and_newer_formats_are_kept_not_served(models, tmp_path):
    """mlx-bun deleted every file its scan could not read (a newer version's included) and
    must never serve another model's entry: mlxkv skips both and keeps them."""
    model = models("llama")
    a = prompt(40, seed=1)
    with _open(model, tmp_path) as s:
        _put(s, model, a)
        s.flush()
        root = s._disk.root
        (src,) = [os.path.join(root, f) for f in _files(s)]
    other = os.path.join(root, "other-model.safetensors")
    newer = os.path.join(root, "newer-format.safetensors")
    unknown = os.path.join(root, "unknown-kind.safetensors")
    tok = os.path.join(root, "other-tokenizer.safetensors")
    for dst in (other, newer, unknown, tok):
        shutil.copy(src, dst)
    rewrite_header(other, lambda h: h.update(configFingerprint="f" * 64))
    rewrite_header(tok, lambda h: h.update(tokenizerHash="0" * 64))
    rewrite_header(newer, lambda h: h.update(formatVersion=FORMAT_VERSION + 1))
    rewrite_header(unknown, lambda h: h["caches"][0].update(kind="kv-from-the-future"))
    os.unlink(src)
    with _open(model, tmp_path) as s:
        assert s.opened.indexed == 0 and sorted(s.opened.skipped) == sorted(
            os.path.basename(p) for p in (other, newer, unknown, tok)
        )
        assert s.take(a + [1]) is None
    assert all(os.path.exists(p) for p in (other, newer, unknown, tok))


def test_damaged_headers_are_quarantined(models, tmp_path):
    model = models("llama")
    a = prompt(40, seed=1)
    with _open(model, tmp_path) as s:
        _put(s, model, a)
        s.flush()
        root = s._disk.root
        (name,) = _files(s)
    with open(os.path.join(root, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(root, name)) - 10)
    with _open(model, tmp_path) as s:
        assert s.opened.quarantined == [name] and s.opened.indexed == 0
    assert os.path.exists(os.path.join(root, "quarantine", name))


def test_dead_temporary_files_are_deleted_live_ones_kept(models, tmp_path):
    model = models("llama")
    with _open(model, tmp_path) as s:
        root = s._disk.root
    dead = os.path.join(root, ".abc.safetensors.x1.tmp")
    open(dead, "wb").write(b"half a file")
    with _open(model, tmp_path) as s:
        assert s.opened.removed_temporaries == [os.path.basename(dead)] and not os.path.exists(dead)
        # another store has the directory open: a recent temporary file may be its write
        fresh = os.path.join(root, ".def.safetensors.x2.tmp")
        old = os.path.join(root, ".ghi.safetensors.x3.tmp")
        open(fresh, "wb").write(b"being written")
        open(old, "wb").write(b"left by a crash long ago")
        os.utime(old, (time.time() - 7200, time.time() - 7200))
        with _open(model, tmp_path) as s2:
            assert s2.opened.removed_temporaries == [os.path.basename(old)]
        assert os.path.exists(fresh)


def test_temporaries_of_killed_writers_are_removed_by_the_scan(models, tmp_path):
    """Writers SIGKILLed mid-save leave recognisable, unlocked temporaries of dead pids:
    opening the store removes them (io/temporaries.py), whoever else has it open."""
    from stress import killed_writers

    model = models("llama")
    with _open(model, tmp_path) as s:
        root = s._disk.root
        assert len(killed_writers(os.path.join(root, "x.safetensors"), 5)) == 5
        with _open(model, tmp_path) as s2:  # another store has the directory open: still provably dead
            assert len(s2.opened.removed_temporaries) == 5
    assert not [n for n in os.listdir(root) if ".mlxkv-tmp." in n]


def test_regression_never_returns_an_entry_needing_a_trim_it_cannot_make(models, tmp_path):
    model = models("llama")
    a = prompt(40, seed=1)
    with _open(model, tmp_path) as s:
        _put(s, model, a, opts={"max_kv_size": 24}, chunk=8)  # wrapped: untrimmable
        s.flush()
    with _open(model, tmp_path) as s:
        assert s.take(a[:30] + [1]) is None
        assert s.take(a[:39] + [1]) is None
        assert s.take(a + [1]).prefix_len == 40


def test_regression_cold_tier_wins_only_with_a_strictly_longer_prefix(models, tmp_path):
    model = models("llama")
    a = prompt(40, seed=1)
    with _open(model, tmp_path) as s:
        _put(s, model, a)
        s.flush()
        assert s.take(a + [1]).tier == "ram"
        s.shrink(n_entries=0)
        assert len(s) == 0 and s.take(a + [1]).tier == "disk"


def test_descendants_replace_ancestors_on_disk_after_their_own_write(models, tmp_path):
    model = models("llama")
    a = prompt(60, seed=1)
    with _open(model, tmp_path) as s:
        _put(s, model, a[:30])
        s.flush()
        assert len(_files(s)) == 1
        _put(s, model, a)
        report = s.flush()
        assert [len(t) for _, t in report.durable] == [60] and len(_files(s)) == 1
    with _open(model, tmp_path) as s:
        assert s.take(a[:30] + [1]).prefix_len == 30


def test_regression_private_directory_and_files(models, tmp_path):
    model = models("llama")
    with _open(model, tmp_path) as s:
        root = s._disk.root
        _put(s, model, prompt(20))
        s.flush()
        (name,) = _files(s)
    os.chmod(root, 0o755)  # made readable by someone: reopening narrows it again
    with _open(model, tmp_path):
        pass
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o600


def test_regression_two_models_share_a_directory_without_touching_each_other(models, tmp_path):
    llama, gemma = models("llama"), models("gemma3")
    a = prompt(40, seed=1)
    with _open(llama, tmp_path) as s:
        _put(s, llama, a)
        s.flush()
    with _open(gemma, tmp_path) as s:
        assert s.opened.indexed == 0 and s.take(a + [1]) is None
        _put(s, gemma, a)
        s.flush()
    with _open(llama, tmp_path) as s:
        assert s.opened.indexed == 1 and s.take(a + [1]).prefix_len == 40


def test_a_failed_write_is_reported_and_retried(models, tmp_path):
    """flush says which entries are not on disk after a failed write (here the directory is
    gone: a real ENOTDIR from the file system), and writes them once the disk is back."""
    model = models("llama")
    a, b = prompt(40, seed=1), prompt(40, seed=2)
    with _open(model, tmp_path) as s:
        root = s._disk.root
        _put(s, model, a)
        assert [len(t) for _, t in s.flush().durable] == [40]
        os.rename(root, root + ".away")
        open(root, "wb").close()  # a file where the directory was
        _put(s, model, b)
        report = s.flush()
        assert report.durable == [] and [(len(t), "SnapshotWriteError" in m) for _, t, m in report.failed] == [
            (40, True)
        ]
        os.unlink(root)
        os.rename(root + ".away", root)
        report = s.flush()
        assert [t for _, t in report.durable] == [b] and report.ok
    with _open(model, tmp_path) as s:
        assert s.opened.indexed == 2


def test_regression_writes_are_bounded_by_the_cap_while_the_disk_is_slow(models, tmp_path):
    """RAM never holds more than the cap, queued writes included: while the disk is slow,
    put waits for the writer instead of piling entries up (mlx-bun's spill queue dropped
    them; mlx-lm has no disk tier)."""
    model = models("llama")
    per_entry = 40 * PER_TOKEN
    store = _open(model, tmp_path, cap=3 * per_entry)
    real_write = store._disk.write
    held = []

    def slow_write(entry):
        time.sleep(0.05)
        return real_write(entry)

    store._disk.write = slow_write
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            held.append(store.nbytes)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(10):
            _put(store, model, prompt(40, seed=100 + i))
            assert store.nbytes <= store.cap
        report = store.flush()
    finally:
        stop.set()
        watcher.join()
        store.close()
    assert max(held) <= 3 * per_entry
    assert len(report.durable) == 10


def test_disk_cap_evicts_least_recently_used_files(models, tmp_path):
    model = models("llama")
    entries = [prompt(40, seed=s) for s in range(4)]
    with _open(model, tmp_path, disk_cap=3 * (40 * PER_TOKEN + 4096)) as s:
        for t in entries[:3]:
            _put(s, model, t)
        s.flush()
        s.shrink(n_entries=0)
        assert s.take(entries[0] + [1]).tier == "disk"  # entries[0] is now the most recent file
        _put(s, model, entries[3])
        s.flush()
        kept = {tuple(e.tokens) for e in s._disk.entries()}
    assert tuple(entries[1]) not in kept and {tuple(entries[0]), tuple(entries[3])} <= kept


# -- generation checkpoints ------------------------------------------------------------------


SAMPLER = Sampler(temp=0.8, top_p=0.9, repetition_penalty=1.1)
PROMPT = prompt(12, seed=5)


def _session(model, scheme="bf16", ns=""):
    return Session.start(model, PROMPT, scheme, sampler=SAMPLER, seed=3, ns=ns)


def test_checkpoints_are_found_by_request_key_and_resume_bit_for_bit(models, tmp_path):
    model = models("llama")
    s = _session(model)
    key = request_key(PROMPT, SAMPLER, seed=3)
    assert s.request_key == key
    with _open(model, tmp_path) as store:
        s.generate(5)
        s.save_to(store)
        s.generate(5)
        s.save_to(store)
        assert store.flush().ok
        assert sum(1 for e in store._disk.entries() if e.checkpoint) == 1  # the longer replaced the shorter
    reference = []
    expected = s.generate(8, lambda t, logits: reference.append(np.array(logits.astype(mx.float32))))
    with _open(model, tmp_path) as store:
        assert store.find_checkpoint(PROMPT, request_key(PROMPT, Sampler(), seed=3)) is None  # another sampler
        assert store.find_checkpoint(PROMPT, request_key(PROMPT, SAMPLER, seed=4)) is None  # another seed
        assert store.find_checkpoint(PROMPT, request_key(PROMPT, SAMPLER)) is None  # a server-default seed
        assert store.find_checkpoint(PROMPT, key, ns="lora-a") is None  # another namespace
        assert store.find_checkpoint(prompt(12, seed=6), key) is None  # another prompt
        assert store.find_checkpoint(PROMPT[:-1], key) is None  # a prompt of another length
        r = store.find_checkpoint(PROMPT, key)
        assert len(r.generated_tokens) == 10 and r.request_key == key
        logits = []
        assert r.generate(8, lambda t, row: logits.append(np.array(row.astype(mx.float32)))) == expected
        np.testing.assert_array_equal(np.stack(logits), np.stack(reference))
        # resuming appended to lent caches: the stored checkpoint is unchanged
        again = store.find_checkpoint(PROMPT, key)
        assert again.generate(8) == expected


def test_a_checkpoint_is_found_only_with_the_cache_options_it_was_made_with(models, tmp_path):
    """Q-Filters' options decide which rows its caches keep (mlx-bun has no Q-Filters: the
    key's ``kvScheme`` is mlxkv's, its canonical scheme): a request with another calibration
    length is another request, and never resumes this one's caches."""
    model = models("llama")
    scheme, made = "qfilters-b8-s2-r2", {"calib_tokens": 4}
    s = Session.start(model, PROMPT, scheme, sampler=SAMPLER, seed=3, **made)
    assert s.request_key == request_key(PROMPT, SAMPLER, seed=3, scheme=scheme, **made)
    with _open(model, tmp_path) as store:
        s.generate(6)
        s.save_to(store)
        other = request_key(PROMPT, SAMPLER, seed=3, scheme=scheme, calib_tokens=8)
        assert other != s.request_key
        assert store.find_checkpoint(PROMPT, other) is None
        assert (
            store.find_checkpoint(PROMPT, request_key(PROMPT, SAMPLER, seed=3, scheme=scheme, sign=-1, **made)) is None
        )
        found = store.find_checkpoint(PROMPT, s.request_key)
        assert found is not None and found.generate(4) == s.generate(4)


def test_a_checkpoint_must_strictly_extend_its_prompt(models, tmp_path):
    """mlx-bun's findGenerationCheckpoint: nothing generated yet, nothing found."""
    model = models("llama")
    s = _session(model, ns="lora-a")
    with _open(model, tmp_path) as store:
        s.save_to(store)
        assert store.find_checkpoint(PROMPT, s.request_key, ns="lora-a") is None
        s.generate(1)
        s.save_to(store)
        assert len(store.find_checkpoint(PROMPT, s.request_key, ns="lora-a").generated_tokens) == 1
        assert store.find_checkpoint(PROMPT, s.request_key) is None


def test_regression_a_newer_checkpoint_supersedes_only_after_its_rename(models, tmp_path):
    model = models("llama")
    s = _session(model)
    with _open(model, tmp_path) as store:
        s.generate(4)
        s.save_to(store)
        assert store.flush().ok
        root = store._disk.root
        os.rename(root, root + ".away")
        open(root, "wb").close()
        s.generate(4)
        s.save_to(store)
        assert not store.flush().ok
        os.unlink(root)
        os.rename(root + ".away", root)
    with _open(model, tmp_path) as store:  # the older checkpoint is still there
        r = store.find_checkpoint(PROMPT, s.request_key)
        assert len(r.generated_tokens) == 4


def test_checkpoints_do_not_serve_prompt_reuse(models, tmp_path):
    model = models("llama")
    s = _session(model)
    s.generate(6)
    with _open(model, tmp_path) as store:
        s.save_to(store)
        assert store.take(s.tokens + [1]) is None
        forward(model, s.caches, [1])


def test_remove_forgets_an_entry_in_every_tier(models, tmp_path):
    model = models("llama")
    a, b = prompt(40, seed=1), prompt(40, seed=2)
    with _open(model, tmp_path) as s:
        _put(s, model, a)
        s.flush()
        _put(s, model, b)
        assert s.remove(a) and s.remove(b)  # b's write may still be queued or running
        s.flush()
        assert s.take(a + [1]) is None and s.take(b + [1]) is None and _files(s) == []
        assert not s.remove(a)


# -- in operation: a cap that drops files, a full file system, the log's bound, trust -------


def _entry_objects(tokens):
    """The entries with arrays alive in this process whose tokens are among ``tokens``."""
    import gc

    from mlxkv.store.entry import Entry

    gc.collect()
    mine = {tuple(t) for t in tokens}
    return [o for o in gc.get_objects() if isinstance(o, Entry) and o.arrays is not None and tuple(o.tokens) in mine]


def test_flush_reports_durable_only_what_the_disk_cap_kept(models, tmp_path):
    """Five entries into a directory capped at two: the flush lists as durable exactly the
    files that are there, the others as evicted."""
    model = models("llama")
    entries = [prompt(40, seed=s) for s in range(5)]
    with _open(model, tmp_path, disk_cap=2 * (40 * PER_TOKEN + 4096)) as s:
        for t in entries:
            _put(s, model, t)
        report = s.flush()
        on_disk = {tuple(e.tokens) for e in s._disk.entries()}
        assert len(_files(s)) == 2
    assert {tuple(t) for _, t in report.durable} == on_disk
    assert {tuple(t) for _, t in report.evicted} == {tuple(t) for t in entries} - on_disk


def test_flush_counts_durable_only_what_the_disk_cap_kept_past_the_log_bound(models, tmp_path):
    """Eight entries into a directory capped at two, with a write log of two records: the
    entries that left the log as durable and were evicted later count as evicted, so the
    flush counts as durable exactly the files that are there (a server's log is always
    past its bound: it never flushes)."""
    model = models("llama")
    with _open(model, tmp_path, disk_cap=2 * (40 * PER_TOKEN + 4096), log_limit=2) as s:
        for seed in range(8):
            _put(s, model, prompt(40, seed=seed))
        report = s.flush()
        files = len(_files(s))
    assert files == 2
    assert len(report.durable) + report.unlisted["durable"] == 2
    assert len(report.evicted) + report.unlisted["evicted"] == 6


def test_a_store_never_flushed_keeps_no_entry_alive_beyond_its_cap(models, tmp_path):
    """The server never flushes: after many puts, the only entries alive are the ones in RAM
    (and a write in flight), and the write log lists at most log_limit of them; a flush
    still counts every one."""
    model = models("llama")
    caches = build(model, "bf16", {}, prompt(40, seed=1), 40)
    per_entry = 40 * PER_TOKEN
    with _open(model, tmp_path, cap=3 * per_entry, log_limit=8) as s:
        for i in range(40):
            s.put(prompt(40, seed=100 + i), caches)
        for q in s._queues.values():
            with s._cond:
                q.wait_idle()
        assert len(_entry_objects(prompt(40, seed=100 + i) for i in range(40))) <= len(s) + 1 <= 4
        assert len(s._log) <= 8 and s.nbytes <= s.cap
        report = s.flush()
        assert len(report.durable) + report.unlisted["durable"] == 40 and not report.failed


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs: a file system that fills up (the tests run as root on CI, as here)."""
    import subprocess

    mount = tmp_path / "fs"
    mount.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"cannot mount a 2 MiB tmpfs (the full-disk tests need root): {out.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_file_system_is_reported_logged_and_nothing_reported_durable_is_lost(models, small_fs, caplog):
    """On a 2 MiB file system, entries of 200 KiB: the first ones are durable, the rest fail
    with the file system's reason; one warning says the disk tier is failing; every entry
    the flush reported durable is served after a restart, whole."""
    import logging

    caplog.set_level(logging.WARNING, logger="mlxkv.store")
    model = models("llama")
    entries = [prompt(100, seed=s) for s in range(16)]
    with _open(model, small_fs / "store") as s:
        for t in entries:
            _put(s, model, t)
        report = s.flush()
        counters = s.counters()["tiers"]["disk"]
    assert report.durable and report.failed
    assert all("No space" in m or "space" in m.lower() for *_, m in report.failed), report.failed[0][2]
    assert len(report.durable) + len(report.failed) == 16
    assert counters["failures"] >= len(report.failed) and not counters["healthy"]
    failing = [r for r in caplog.records if "disk tier" in r.getMessage() and "failing" in r.getMessage()]
    assert len(failing) == 1
    with _open(model, small_fs / "store") as again:
        assert again.opened.indexed == len(report.durable)
        for _, t in report.durable:
            hit = again.take(list(t) + [1])
            assert hit is not None and hit.tier == "disk" and hit.prefix_len == 100


def test_the_disk_tier_trusts_only_this_users_private_directories(models, tmp_path):
    """A store directory other users may write is refused; an identity directory another
    user owns is refused; a file another user owns, or a link, is never read."""
    model = models("llama")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(StoreTrustError, match="other users"):
        _open(model, shared)
    os.chmod(shared, 0o1777)  # sticky, as /tmp: others cannot replace this user's files
    _open(model, shared).close()

    d = tmp_path / "d"
    a, b = prompt(40, seed=1), prompt(40, seed=2)
    with _open(model, d) as s:
        _put(s, model, a)
        _put(s, model, b)
        s.flush()
        root = s._disk.root
    name_a, name_b = sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
    os.chown(os.path.join(root, name_a), 65534, 65534)  # nobody's now
    os.rename(os.path.join(root, name_b), str(tmp_path / "elsewhere.safetensors"))
    os.symlink(str(tmp_path / "elsewhere.safetensors"), os.path.join(root, name_b))
    with _open(model, d) as s:
        assert s.opened.indexed == 0 and sorted(s.opened.untrusted) == sorted([name_a, name_b])
        assert s.take(a + [1]) is None and s.take(b + [1]) is None
    os.chown(root, 65534, 65534)
    with pytest.raises(StoreTrustError, match="not a directory of this user"):
        _open(model, d)


def test_a_regular_file_as_the_store_directory_is_refused(models, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(MLXKVError, match="not a directory"):
        _open(models("llama"), f)
