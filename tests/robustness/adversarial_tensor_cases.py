"""Adversarial cases for the tensors a cache reads and hands out (t: the fast paths' tensor
reads, index tensors that outlive the call) and for the host tier's callbacks (h: ``backup``
and ``evict_host``'s free callback). Each case is a function of the core under test, run alone
in a subprocess by ``test_adversarial.py``.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import numpy as np
import torch

from radixcache import RadixCache
from conftest import check_invariants, core_of, node_tokens
from adversarial_support import (REENTERED, case, consistent,
                                 contents, only_reentry_errors, outcome, same_as_pure)


# -- the fast paths' tensor reads ----------------------------------------------------------


@case
def t1_zero_tensor_has_no_data(core_name):
    # torch._efficientzerotensor: an exact CPU int64 1-D contiguous tensor with no storage
    # (data pointer NULL); reading it through its data pointer crashes.
    def run(core):
        cache = RadixCache(core=core)
        cache.insert(list(range(8)), list(range(8)))
        found = []
        for size in (8, 0):  # an empty one too: no data to read, yet still torch's error
            zeros = torch._efficientzerotensor(size, dtype=torch.int64)
            found += [outcome(lambda: cache.match_prefix(zeros).length),
                      outcome(lambda: cache.exists(zeros)),
                      outcome(lambda: cache.insert(zeros).prefix_len),
                      outcome(lambda: cache.insert(list(range(20, 28)), zeros).prefix_len),
                      outcome(lambda: cache.match_prefix(zeros, extra_key="k").length)]
        check_invariants(cache)
        return found, contents(cache)
    same_as_pure(run, core_name)


@case
def t3_tensor_attributes_set_on_the_instance(core_name):
    # A tensor has a __dict__: an attribute set there shadows a method (t.data_ptr = ...).
    # The facts a core reads memory by (device, dtype, dimensions, contiguity, negative
    # bit, size, address) must be the tensor's own: lies here pointed the compiled core at
    # address 16 (a crash), read an expanded tensor's one element as eight, read a negative
    # view raw and a 2-D tensor as 1-D. Each call must do what it does on the same tensor
    # without the attributes.
    from radixcache.workloads import KVPool

    LIES = {"data_ptr": lambda: 16, "is_contiguous": lambda *a, **k: True,
            "dim": lambda: 1, "is_neg": lambda: False}

    def lying(tensor):
        for name, lie in LIES.items():
            setattr(tensor, name, lie)
        return tensor

    def inputs():
        seq = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
        return {"plain": seq, "expanded": torch.tensor([1]).expand(8),
                "negative": torch._neg_view(-seq), "two_d": seq.reshape(2, 4),
                "strided": torch.arange(1, 17)[::2]}

    def run(core):
        found = []
        for lie in (False, True):
            cache = RadixCache(core=core)
            cache.insert([1, 2, 3, 4, 5, 6, 7, 8], list(range(100, 108)))
            cache.insert([1, 1, 1, 1], list(range(200, 204)))
            for name, tokens in inputs().items():
                tokens = lying(tokens) if lie else tokens
                kv = lying(torch.arange(300, 308)) if lie else torch.arange(300, 308)
                found += [name, outcome(lambda: cache.match_prefix(tokens).indices.tolist()),
                          outcome(lambda: cache.exists(tokens)),
                          outcome(lambda: cache.insert(tokens).prefix_len),
                          outcome(lambda: cache.insert([9] + list(range(len(kv) - 1)),
                                                       kv).prefix_len)]
            check_invariants(cache)
            found.append(contents(cache))
            pool = KVPool(32)
            _taken = pool.alloc(32)  # the pool is full: free() gets slots it handed out
            for slots in (torch.arange(8), torch.tensor([3]).expand(4),
                          torch._neg_view(torch.arange(-31, -23)), torch.arange(16)[::2]):
                slots = lying(slots) if lie else slots
                found.append(outcome(lambda: pool.free(slots)))
            found.append(pool.free_slots().tolist())
        assert found[:len(found) // 2] == found[len(found) // 2:], found
        return found
    same_as_pure(run, core_name)


@case
def t4_tokens_written_during_the_call(core_name):
    # Another thread (numpy and torch drop the GIL inside their loops) or another process
    # sharing the memory can write a call's token array while the core reads it. The answers
    # are then whatever the tokens were; the tree must stay well formed. Here a second
    # process flips the last 8 of 12 tokens between all 1 and all 2 as fast as it can, over a
    # file both map. Before: a match whose second read of a page differed from its first
    # split a node at 0 tokens (an empty node); an insert whose new leaf, copied after the
    # walk, began with a sibling's first page made two children of one first page, and with
    # a host tier left adopted nodes off the heap. An insert that sees its tokens change
    # says so (RuntimeError) and changes nothing that counts.
    import mmap
    import subprocess
    import tempfile

    FLIP = "\n".join([
        "import sys, numpy as np",
        "tail = np.memmap(sys.argv[1], dtype=np.int64, mode='r+')[4:]",
        "while True:",
        "    tail[:] = 2",
        "    tail[:] = 1",
    ])
    with tempfile.NamedTemporaryFile(suffix=".tokens", delete=False) as f:
        f.write(np.full(12, 7, dtype=np.int64).tobytes())
        path = f.name
    fd = os.open(path, os.O_RDWR)
    shared = mmap.mmap(fd, 96)
    tokens = np.frombuffer(shared, dtype=np.int64)
    assert type(tokens) is np.ndarray and tokens.flags.writeable
    flipper = subprocess.Popen([sys.executable, "-c", FLIP, path])
    seen = {}
    try:
        deadline = time.monotonic() + 60
        while tokens[4] == 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tokens[4] in (1, 2), "the flipping process did not start"
        for phase in ("insert", "tiered", "match"):
            cache = RadixCache(core=core_name, host_tier=phase == "tiered")
            cache.insert([7] * 4 + [1] * 8)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                if phase == "match":
                    if cache.node_count() > 32:
                        cache.reset()
                        cache.insert([7] * 4 + [1] * 8)
                    cache.match_prefix(tokens)
                    check_invariants(cache)
                    continue
                cache.reset()
                cache.insert([7] * 4 + [2] * 8, list(range(100, 112)))
                if phase == "tiered":  # host only: an insert through it adopts them
                    cache.insert([7] * 4 + [3] * 8, list(range(200, 212)))
                    cache.evict(100, backup=lambda device: device + 900)
                sizes = lambda: (cache.total_size(), cache.evictable_size(),
                                 cache.host_size() if phase == "tiered" else 0)
                before = sizes()
                try:
                    cache.insert(tokens, torch.arange(500, 512))
                    key = phase + " inserted"
                except RuntimeError as exc:
                    assert "token_ids changed while insert read them" in str(exc), exc
                    assert sizes() == before  # (a split may stay: it changes no content)
                    key = phase + " refused"
                seen[key] = seen.get(key, 0) + 1
                check_invariants(cache)
    finally:
        flipper.kill()
        flipper.wait()
        del tokens
        shared.close()
        os.close(fd)
        os.unlink(path)
    assert seen.get("insert inserted") and seen.get("tiered inserted"), seen
    print(seen)


@case
def t2_index_tensor_outlives_and_owns_its_memory(core_name):
    # The compiled core returns hits as a tensor over its own malloc'd block (DLPack): the
    # block must outlive the cache, be the caller's to write, and be freed with the tensor.
    def rss():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    def run(core):
        seq = list(range(3000))
        cache = RadixCache(core=core)
        cache.insert(seq, list(range(5000, 8000)))
        kept = [cache.match_prefix(seq).indices for _ in range(3)]
        kept[0].numpy()[:] = -1                        # the caller's copy: the cache keeps its own
        kept[1].add_(1)
        again = cache.match_prefix(seq).indices.tolist()
        cache.evict(10**9)
        cache.reset()
        del cache
        gc.collect()
        _junk = [bytes(24_000) for _ in range(200)]  # reuse freed memory, if any was freed
        return again, [t.tolist() for t in kept], int(kept[2].numpy().sum())
    same_as_pure(run, core_name)

    if os.path.exists("/proc/self/statm"):
        seq = list(range(3000))
        cache = RadixCache(core=core_name)
        cache.insert(seq, list(range(3000)))
        for _ in range(2000):
            cache.match_prefix(seq)
        base = rss()
        for _ in range(50_000):                       # 1.2 GB if no block were freed
            cache.match_prefix(seq).indices.numpy()
        assert rss() - base < 64 * 2**20, (rss() - base) / 2**20


# -- 9: the host tier's callbacks (backup, evict_host's free_callback) -----------------------
# backup is user code called under the guard, like on_remove: a call into the cache from it
# raises RuntimeError and the victim stays; whatever torch code a returned tensor runs, the
# core checks what it got after the last call, and nothing read before a call is trusted.


def tiered(cache):
    """Everything a host-tier cache holds, comparable across cores."""
    out = []
    for node, _depth in core_of(cache).tree.iter_nodes():
        if node.parent is None:
            continue
        value, host = node.value, node.host_value
        out.append((tuple(node_tokens(node)), node.tier, node.lock_ref,
                    None if value is None else tuple(value.tolist()),
                    None if host is None else tuple(host.tolist())))
    return sorted(out), cache.evictable_size(), cache.host_size(), cache.stats()


def host_cache(core, policy="write_back"):
    """Three prompts sharing a prefix, one of them on the host only."""
    cache = RadixCache(core=core, host_tier=True, write_policy=policy)
    cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
    cache.insert([1, 2, 5, 6], [11, 12, 15, 16])
    cache.insert([7, 8], [17, 18])
    cache.evict(2, backup=lambda d: d + 100)   # one leaf demoted to the host
    return cache


def host_consistent(cache):
    check_invariants(cache)
    cache.evict(10**6, backup=lambda d: d + 1000)
    cache.evict_host(10**6)
    assert cache.evictable_size() == 0 and cache.host_size() == 0, tiered(cache)
    consistent(cache)


@case
def h1_backup_calls_the_cache(core_name):
    def run(core):
        outcomes = []
        for call in ("insert", "match_prefix", "evict", "evict_host", "load_back", "reset"):
            cache = host_cache(core)
            before = tiered(cache)
            def backup(device, cache=cache, call=call):
                if call == "insert":
                    cache.insert([9, 9])
                elif call == "match_prefix":
                    cache.match_prefix([1, 2])
                elif call == "evict":
                    cache.evict(100)
                elif call == "evict_host":
                    cache.evict_host(100)
                elif call == "load_back":
                    cache.load_back(cache.match_prefix([1, 2]), [])
                else:
                    cache.reset()
                return device + 100
            outcomes.append(outcome(lambda: cache.evict(100, backup=backup)))
            assert outcomes[-1] == ("RuntimeError", True), outcomes
            assert tiered(cache) == before, (tiered(cache), before)   # the victim stayed
            host_consistent(cache)
        return outcomes
    same_as_pure(run, core_name)


@case
def h2_backup_returns_odd_tensors(core_name):
    class Calls(torch.Tensor):
        # Calls the cache from inside a torch function (the checks of the returned tensor).
        cache = None
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if cls.cache is not None:
                cls.cache.insert([5, 5])
            return super().__torch_function__(func, types, args, kwargs or {})

    def run(core):
        outcomes = []
        makers = [
            lambda d: (d + 100).as_subclass(Calls),
            lambda d: (d + 100).tolist(),
            lambda d: (d + 100).to(torch.int32),
            lambda d: (d + 100)[:1],
            lambda d: (d + 100).unsqueeze(0),
            lambda d: np.asarray(d + 100),
        ]
        for make in makers:
            cache = host_cache(core)
            Calls.cache = cache
            before = tiered(cache)
            outcomes.append(outcome(lambda: cache.evict(100, backup=make)))
            Calls.cache = None
            assert outcomes[-1][0] != "ok", outcomes
            assert tiered(cache) == before, (tiered(cache), before)
            host_consistent(cache)
        # A good tensor on which a hook ran: the node keeps the values it saw.
        cache = host_cache(core)
        kept = []
        def backup(device):
            host = device + 100
            kept.append(host)
            return host
        cache.evict(100, backup=backup)
        for host in kept:
            host.fill_(-1)   # the caller's tensor: the cache kept a copy
        check_invariants(cache)
        return outcomes, tiered(cache)
    same_as_pure(run, core_name)


@case
def h2_backup_tensor_converts_to_another_length(core_name):
    class Lying(torch.Tensor):
        # Answers every check like a good tensor, then converts to another length.
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            out = super().__torch_function__(func, types, args, kwargs or {})
            if getattr(func, "__name__", "") == "numpy":
                return np.arange(1000, dtype=np.int64)
            return out

    cache = host_cache(core_name)
    before = tiered(cache)
    try:
        cache.evict(100, backup=lambda d: (d + 100).as_subclass(Lying))
    except ValueError as exc:
        assert "host indices for" in str(exc), exc
    else:
        raise AssertionError("a host value of the wrong length was kept")
    assert tiered(cache) == before, (tiered(cache), before)
    host_consistent(cache)


@case
def h3_evict_host_callback_calls_the_cache(core_name):
    def run(core):
        cache = host_cache(core)
        cache.evict(10**6, backup=lambda d: d + 100)   # everything on the host only
        seen = []
        def free(host):
            seen.append(host.tolist())
            # Allowed: the guard is released around a per-node callback.
            cache.insert([1, 2, 40 + len(seen)], [21, 22, 23])
            seen.append(cache.match_prefix([1, 2, 3, 4]).host_length)
            cache.evict_host(2)
        freed = cache.evict_host(10**6, free)
        host_consistent(cache)
        # batch: called once, after the loop, outside the guard
        cache = host_cache(core)
        cache.evict(10**6, backup=lambda d: d + 100)
        batched = []
        cache.evict_host(10**6, lambda h: batched.append((h.tolist(), cache.insert([3, 3]))),
                         batch=True)
        host_consistent(cache)
        return freed, seen, [b[0] for b in batched]
    same_as_pure(run, core_name)


@case
def h4_finalizer_during_demotion(core_name):
    class Trap:
        # Set off by a collection inside a host-tier call: calls the cache from a finalizer.
        cache = None
        def __del__(self):
            if Trap.cache is not None:
                Trap.cache.insert([6, 6, 6])

    def make_garbage():
        for _ in range(50):
            a, b = Trap(), Trap()
            a.other, b.other = b, a   # a cycle: only a collection frees it

    cache = RadixCache(core=core_name, host_tier=True, write_policy="write_through")
    Trap.cache = cache
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        for round in range(30):
            for i in range(20):
                cache.insert([round, i, 1, 2], list(range(4)))
                cache.match_prefix([round, i, 1, 2])
            make_garbage()
            cache.write_through(lambda d: (make_garbage(), d + 500)[1])
            make_garbage()
            cache.evict(40, lambda v: make_garbage(), backup=lambda d: d + 900)
            m = cache.match_prefix([round, 0, 1, 2])
            make_garbage()
            if m.host_length:
                cache.load_back(m, list(range(900, 900 + m.host_length)))
            cache.evict_host(10, lambda h: make_garbage())
            check_invariants(cache)
    finally:
        gc.set_threshold(*old)
        Trap.cache = None
    gc.collect()
    only_reentry_errors()
    host_consistent(cache)


@case
def h5_backup_meets_another_thread(core_name):
    def run(core):
        cache = host_cache(core)
        before = tiered(cache)
        errors = []
        def backup(device):
            def other():
                try:
                    cache.insert([4, 4])
                except RuntimeError as exc:
                    errors.append(REENTERED in str(exc))
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            return None   # the host is full: the victim is deleted as without a host tier
        freed = cache.evict(3, backup=backup)
        host_consistent(cache)
        return freed, errors, before
    same_as_pure(run, core_name)


@case
def h6_write_through_backup_calls_the_cache(core_name):
    def run(core):
        cache = RadixCache(core=core, host_tier=True, write_policy="write_through")
        cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
        cache.insert([1, 2, 5, 6], [11, 12, 15, 16])
        before = tiered(cache)
        def backup(device):
            cache.match_prefix([1, 2])
            return device + 100
        first = outcome(lambda: cache.write_through(backup))
        assert first == ("RuntimeError", True), first
        assert tiered(cache) == before
        copied = cache.write_through(lambda d: d + 100)   # the queue was kept
        check_invariants(cache)
        # raising half way: the copies made so far stay, the rest stays queued
        cache.insert([8, 8, 8], [1, 2, 3])
        cache.insert([9, 9], [4, 5])
        calls = []
        def flaky(device):
            calls.append(device.tolist())
            if len(calls) == 2:
                raise KeyError("host pool")
            return device + 200
        second = outcome(lambda: cache.write_through(flaky))
        third = cache.write_through(lambda d: d + 300)
        host_consistent(cache)
        return first, copied, second, third, calls
    same_as_pure(run, core_name)


@case
def h7_evict_free_callback_uses_both_tiers(core_name):
    def run(core):
        cache = host_cache(core)
        seen = []
        def free(device):
            # Allowed: the guard is released around a per-node callback. Adopt, load back,
            # evict the host, evict again (nested), while the outer loop is between victims.
            seen.append(device.tolist())
            cache.insert([1, 2, 3, 4], [31, 32, 33, 34])
            m = cache.match_prefix([1, 2, 5, 6])
            seen.append((m.length, m.host_length))
            if m.host_length:
                seen.append(cache.load_back(m, list(range(60, 60 + m.host_length))).tolist())
            seen.append(cache.evict_host(1))
            seen.append(cache.evict(1, backup=lambda d: d + 300))
            check_invariants(cache)
        freed = cache.evict(12, free, backup=lambda d: d + 100)
        host_consistent(cache)
        return freed, seen
    same_as_pure(run, core_name)


@case
def h8_batch_backup_keeps_and_writes_its_tensor(core_name):
    import threading

    def run(core):
        cache = RadixCache(core=core, host_tier=True)
        sizes = [3, 700, 5, 300, 2000, 1, 260, 900, 40, 1500, 7, 333]
        for i, size in enumerate(sizes):
            cache.insert([10**6 * (i + 1) + t for t in range(size)])  # the keys are the indices
        cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
        cache.insert([1, 2, 5, 6], [11, 12, 15, 16])
        kept, seen, batches = [], [], []
        calls = [0]

        def backup(device):
            # Keeps its tensor (beyond the call), writes into it, says the host is full
            # (None) or fails now and then: nothing kept may change afterwards.
            calls[0] += 1
            kept.append(device)
            if len(device) > 2:
                device[1] = -calls[0]   # during the call: shows in the batch
            seen.append(device.tolist())
            if calls[0] % 4 == 0:
                return None
            if calls[0] == 7:
                raise KeyError("host pool")
            return device + 5 * 10**7

        outcomes = []
        for target in (10, 2500, 10**9, 10**9):
            outcomes.append(outcome(lambda: cache.evict(target, batches.append, batch=True,
                                                        backup=backup)))
            check_invariants(cache)
        # The prefix [1, 2] has host-only children now: a None from backup skips it.
        outcomes.append(outcome(lambda: cache.evict(10**9, batches.append, batch=True,
                                                    backup=lambda d: kept.append(d))))
        check_invariants(cache)
        assert [t.tolist() for t in kept[:len(seen)]] == seen  # never overwritten
        # The tensors die on another thread (their memory is the batch's).
        worker = threading.Thread(target=lambda items=list(kept): items.clear())
        kept.clear()
        worker.start()
        worker.join()
        host_consistent(cache)
        return outcomes, seen, [t.tolist() for t in batches], tiered(cache)
    same_as_pure(run, core_name)
