"""``radixcache serve`` against an in-process index: vLLM 0.33's and SGLang 0.5.23's own
``ZmqEventPublisher`` classes publish random batches (stores extending what each holds,
host copies, removals on either tier, clears; sequences under every LoRA and salt; two
data-parallel ranks of one instance; instances in another tenant and another model; one
registered with a LoRA and salt of its own), the service (on each tree core) subscribes to
them, and after the batches every ``/query`` answer, for every scope and every LoRA and salt,
equals what in-process ``KvIndexer``s fed the same batches give; and ``/query_by_hash`` with
the prompt's standard sequence hashes (the service runs with ``--hash-index``) answers as
``/query`` does.

The reference keeps one ``KvIndexer`` per instance, rank and block identity (its LoRA and
salt as the engine named them, or the registration's), fed that identity's blocks without
their LoRA and salt: so it shares none of the service's namespace rules. Its tier figures
walk the prompt block by block (each block's holders read alone), as Mooncake's conductor
describes the cursor: device, then host, then disk.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("zmq")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
xxhash = pytest.importorskip("xxhash")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "events"))

from engine_publishers import load_sglang_kv_events, load_vllm_kv_events, short_workdir
from service_helpers import Service, register_body, wait_until

from radixcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from radixcache.router import KvIndexer

BS = 2
LORAS = (None, "ad")
SALTS = (None, "s")
#: (instance, dp_rank, engine, tenant, model, registered lora, registered salt)
REGISTRATIONS = [
    ("v0", 0, "vllm", "default", "m", None, None),
    ("v0", 1, "vllm", "default", "m", None, None),
    ("s1", 0, "sglang", "default", "m", None, None),
    ("s2", 0, "sglang", "acme", "m", None, None),
    ("v3", 0, "vllm", "default", "other", None, None),
    ("v4", 0, "vllm", "default", "m", "ad", "w8"),
]
SCOPES = [("default", "m"), ("acme", "m"), ("default", "other")]
QUERY_IDENTITIES = [(None, None), ("ad", None), (None, "s"), ("ad", "s"), ("ad", "w8")]


@pytest.fixture(scope="module")
def engines():
    if sys.version_info < (3, 10):
        pytest.skip("vLLM's kv_events.py needs Python >= 3.10")
    modules = {}
    try:
        modules["vllm"] = load_vllm_kv_events()
    except FileNotFoundError as exc:
        if os.environ.get("RADIXCACHE_REQUIRE_VLLM_SCHEMA") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    try:
        modules["sglang"] = load_sglang_kv_events()
    except Exception as exc:  # ImportError, or one of SGLang's own imports failing
        if os.environ.get("RADIXCACHE_REQUIRE_SGLANG") == "1":
            raise
        pytest.skip(f"SGLang 0.5.23 is not importable: {exc}")
    return modules


class Publisher:
    """One registration's engine publisher, the sequences it holds, and the reference."""

    def __init__(self, spec: tuple, module, workdir: str, index: int) -> None:
        self.instance, self.rank, self.engine, self.tenant, self.model, lora, salt = spec
        self.defaults = (lora, salt)
        self.module = module
        if self.engine == "vllm":
            # Rank 0 for every one: vLLM derives a rank's endpoints from rank 0's for tcp only
            # (the registration names the rank; the batches' own is not read).
            self.pub = module.ZmqEventPublisher(
                data_parallel_rank=0, endpoint=f"ipc://{workdir}/p{index}",
                replay_endpoint=f"ipc://{workdir}/r{index}", buffer_steps=10_000, topic="kv")
            config = self.pub.get_publisher_config()
            self.endpoint, self.replay = config.endpoint, config.replay_endpoint
        else:
            self.pub = module.ZmqEventPublisher(
                attn_dp_rank=self.rank, endpoint="tcp://127.0.0.1:*",
                replay_endpoint="tcp://127.0.0.1:*", buffer_steps=10_000, topic="kv", bind=True)
            source = self.pub.describe_local_source(block_size=BS)
            self.endpoint, self.replay = source["endpoint"], source["replay_endpoint"]
        self.sent = 0
        self.next_hash = (index + 1) * 1_000_000
        self.seqs: list = []  # [tokens, hashes, identity, held on GPU (count), on CPU (count)]
        self.reference: dict = {}  # effective identity -> KvIndexer

    def body(self) -> dict:
        lora, salt = self.defaults
        extra = {"tenant_id": self.tenant, "dp_rank": self.rank}
        if lora:
            extra["lora_name"] = lora
        if salt:
            extra["additionalsalt"] = salt
        return register_body(self.instance, self.endpoint, self.replay,
                             kind="vLLM" if self.engine == "vllm" else "SGLang",
                             model=self.model, block_size=BS, **extra)

    def effective(self, identity: tuple) -> tuple:
        return (identity[0] or self.defaults[0], identity[1] or self.defaults[1])

    def ref(self, identity: tuple) -> KvIndexer:
        key = self.effective(identity)
        if key not in self.reference:
            self.reference[key] = KvIndexer(BS)
        return self.reference[key]

    # -- the engines' events ------------------------------------------------------------
    def stored(self, seq: list, start: int, end: int, medium: str):
        tokens, hashes, (lora, salt) = seq[0], seq[1], seq[2]
        parent = hashes[start - 1] if start else None
        part = tokens[start * BS:end * BS]
        if self.engine == "vllm":
            entries = None
            if lora or salt:  # vLLM: the LoRA on every block, the salt on the first only
                entries = []
                for i in range(start, end):
                    keys = ((lora,) if lora else ()) + ((salt,) if salt and i == 0 else ())
                    entries.append(keys or None)
            event = self.module.BlockStored(
                block_hashes=hashes[start:end], parent_block_hash=parent, token_ids=part,
                block_size=BS, lora_id=None, medium=medium, lora_name=lora, extra_keys=entries)
        else:
            event = self.module.BlockStored(
                block_hashes=hashes[start:end], parent_block_hash=parent, token_ids=part,
                block_size=BS, lora_id=None, medium="CPU_PINNED" if medium == "CPU" else medium,
                cache_salt=salt, lora_name=lora)
        plain = BlockStored(tuple(hashes[start:end]), parent, tuple(part), BS, None, medium)
        return event, lambda: self.ref(seq[2]).apply(0, [plain])

    def removed(self, seq: list, start: int, end: int, medium: str):
        event = self.module.BlockRemoved(
            block_hashes=seq[1][start:end],
            medium="CPU_PINNED" if medium == "CPU" and self.engine == "sglang" else medium)
        plain = BlockRemoved(tuple(seq[1][start:end]), medium)
        return event, lambda: self.ref(seq[2]).apply(0, [plain])

    def step(self, rnd: random.Random, prompts: list) -> None:
        """One batch of one to three random events, published and applied to the
        reference."""
        events, applies = [], []
        for _ in range(rnd.randrange(1, 4)):
            roll = rnd.random()
            held = [s for s in self.seqs if s[3]]
            if roll < 0.35 or not held:  # a new sequence from the root
                base = rnd.choice(prompts)
                n = rnd.randrange(1, 5)
                tokens = base[:n * BS]
                if rnd.random() < 0.3:
                    tokens = tokens[:BS] + [rnd.randrange(500, 600) for _ in range((n - 1) * BS)]
                identity = (rnd.choice(LORAS), rnd.choice(SALTS))
                hashes = list(range(self.next_hash, self.next_hash + n))
                self.next_hash += n
                seq = [tokens, hashes, identity, n, 0]
                self.seqs.append(seq)
                ev, ap = self.stored(seq, 0, n, "GPU")
            elif roll < 0.6:  # extend a sequence held on the device
                seq = rnd.choice(held)
                if seq[3] < len(seq[1]):  # only the first blocks are held: store them again
                    ev, ap = self.stored(seq, seq[3], len(seq[1]), "GPU")
                    seq[3] = len(seq[1])
                else:
                    base = next((p for p in prompts if p[:len(seq[0])] == seq[0]), None)
                    n = rnd.randrange(1, 3)
                    more = (base[len(seq[0]):len(seq[0]) + n * BS] if base is not None
                            and len(base) >= len(seq[0]) + n * BS else
                            [rnd.randrange(500, 600) for _ in range(n * BS)])
                    seq[0] = seq[0] + more
                    seq[1] = seq[1] + list(range(self.next_hash, self.next_hash + n))
                    self.next_hash += n
                    ev, ap = self.stored(seq, seq[3], len(seq[1]), "GPU")
                    seq[3] = len(seq[1])
            elif roll < 0.75:  # a host copy of a sequence's tail
                seq = rnd.choice(held)
                start = rnd.randrange(0, seq[3])
                ev, ap = self.stored(seq, start, seq[3], "CPU")
                seq[4] = max(seq[4], seq[3])
            elif roll < 0.95:  # the device evicts a leaf block or two
                seq = rnd.choice(held)
                k = rnd.randrange(1, min(2, seq[3]) + 1)
                ev, ap = self.removed(seq, seq[3] - k, seq[3], "GPU")
                seq[3] -= k
            else:
                cpu = [s for s in self.seqs if s[4]]
                if cpu and rnd.random() < 0.7:
                    seq = rnd.choice(cpu)
                    ev, ap = self.removed(seq, 0, seq[4], "CPU")
                    seq[4] = 0
                else:
                    ev = self.module.AllBlocksCleared()
                    self.seqs = []

                    def ap() -> None:
                        for ref in self.reference.values():
                            ref.apply(0, [AllBlocksCleared()])
            events.append(ev)
            applies.append(ap)
        self.pub.publish(self.module.KVEventBatch(ts=time.time(), events=events))
        self.sent += 1
        for ap in applies:
            ap()

    def cursor(self, identity: tuple, tokens: list) -> tuple:
        """(gpu, cpu, disk) blocks: the reference's cursor, block by block."""
        ref = self.reference.get(identity)  # the blocks whose identity is the query's
        if ref is None:
            return (0, 0, 0)
        keys = ref.block_keys(tokens)

        def held(i: int, medium: str) -> bool:
            return bool(ref.overlap_keys([keys[i]], medium))

        out, pos = [], 0
        for medium in ("GPU", "CPU", "DISK"):
            while pos < len(keys) and held(pos, medium):
                pos += 1
            out.append(pos)
        return tuple(out)

    def shutdown(self) -> None:
        self.pub.shutdown()


def expected(publishers: list, tenant: str, model: str, identity: tuple, tokens: list) -> dict:
    """Mooncake's answer, from the reference: every instance of the scope."""
    found: dict = {}
    for p in publishers:
        if (p.tenant, p.model) != (tenant, model):
            continue
        g, c, d = (b * BS for b in p.cursor(identity, tokens))
        entry = found.setdefault(p.instance, {"longest_matched": 0, "GPU": 0, "DP": {},
                                              "CPU": 0, "DISK": 0})
        entry["DP"][str(p.rank)] = max(entry["DP"].get(str(p.rank), 0), g)
        entry["GPU"], entry["CPU"] = max(entry["GPU"], g), max(entry["CPU"], c)
        entry["DISK"] = entry["longest_matched"] = max(entry["DISK"], d)
    return {tenant: found} if found else {}


def standard_seqs(tokens: list) -> list:
    """The document's sequence hashes (seed 1337), written out here."""
    out = []
    for i in range(len(tokens) // BS):
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{BS}I", *tokens[i * BS:(i + 1) * BS]),
                                         seed=1337)
        out.append(local if not out else xxhash.xxh3_64_intdigest(
            struct.pack("<QQ", out[-1], local), seed=1337))
    return out


def test_answers_equal_an_in_process_index(core_name, engines):
    rnd = random.Random(1403)
    prompts = [[rnd.randrange(1, 400) for _ in range(12 * BS)] for _ in range(3)]
    workdir = short_workdir()
    publishers = []
    svc = Service("--hash-index", core=core_name)
    try:
        for i, spec in enumerate(REGISTRATIONS):
            publishers.append(Publisher(spec, engines[spec[2]], workdir, i))
        for p in publishers:
            r = svc.post("/register", p.body())
            assert r.status_code == 200, r.text

        def applied() -> bool:
            batches = {(w["instance_id"], w["dp_rank"]): w["batches"]
                       for w in svc.client.get("/workers").json()}
            return all(batches.get((p.instance, p.rank)) == p.sent for p in publishers)

        checked = 0
        for step in range(60):
            rnd.choice(publishers).step(rnd, prompts)
            if step % 4 != 3:
                continue
            wait_until(applied, "every batch applied")
            for tenant, model in SCOPES:
                for identity in QUERY_IDENTITIES:
                    for tokens in prompts:
                        body = {"model": model, "token_ids": tokens, "block_size": BS,
                                "tenant_id": tenant}
                        if identity[0]:
                            body["lora_name"] = identity[0]
                        if identity[1]:
                            body["cache_salt"] = identity[1]
                        got = svc.post("/query", body).json()
                        want = expected(publishers, tenant, model, identity, tokens)
                        assert got == want, (step, tenant, model, identity)
                        del body["token_ids"]
                        by_hash = svc.post("/query_by_hash", {
                            **body, "seq_hashes": standard_seqs(tokens)}).json()
                        assert by_hash == want, ("by hash", step, tenant, model, identity)
                        checked += bool(want and any(
                            e["GPU"] for e in want[tenant].values()))
        assert checked > 20  # the answers compared were not all empty
        assert all(w["malformed"] == 0 and w["gaps"] == 0
                   for w in svc.client.get("/workers").json())
    finally:
        for p in publishers:
            p.shutdown()
        assert svc.stop() == 0, svc.output()
        shutil.rmtree(workdir, ignore_errors=True)
