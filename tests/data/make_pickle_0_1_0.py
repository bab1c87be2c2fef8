"""How tests/data/radixcache-0.1.0.pickle was made, with radixcache 0.1.0 (the flat module layout):
``python tests/data/make_pickle_0_1_0.py tests/data/radixcache-0.1.0.pickle``. Kept to show what the
pickle holds; run today it would pickle under the current import paths."""
import pickle, sys, torch, numpy as np
from radixcache import RadixCache
from radixcache.events import BlockStored, BlockRemoved, AllBlocksCleared, ReceivedBatch, TokenIds
from radixcache.router import IndexerStats
from radixcache.workloads import Request, ServeResult
from radixcache.fleet import TimeModel, FleetResult
from radixcache._options import EventLag

objs = {}
for core in ("c", "python"):
    c = RadixCache(page_size=2, eviction_policy="lru", core=core)
    c.insert([1, 2, 3, 4, 5, 6], torch.arange(6))
    c.insert([1, 2, 3, 4, 9, 9], torch.tensor([0, 1, 2, 3, 40, 41]), extra_key=None, priority=2)
    c.insert([7, 7], extra_key="tenant")
    m = c.match_prefix([1, 2, 3, 4, 5, 7])
    h = RadixCache(page_size=1, host_tier=True, core=core)
    h.insert([1, 2, 3, 4], torch.arange(4)); h.insert([1, 2, 8], torch.tensor([0, 1, 9]))
    h.evict(1, backup=lambda d: torch.arange(100, 100 + len(d)))
    n = RadixCache(page_size=1, array_type="numpy", core=core)
    n.insert([5, 6, 7], np.arange(3))
    objs[f"cache_{core}"] = c
    objs[f"host_cache_{core}"] = h
    objs[f"numpy_cache_{core}"] = n
objs["stats"] = c.stats()
objs["stored"] = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2, lora_id=None, medium="GPU")
objs["removed"] = BlockRemoved(block_hashes=[2], medium="GPU")
objs["cleared"] = AllBlocksCleared()
objs["time_model"] = TimeModel()
objs["event_lag"] = EventLag(3, 0.0)
objs["request"] = Request([1, 2, 3], 2)
for name, o in list(objs.items()):
    try:
        pickle.loads(pickle.dumps(o))
    except Exception as e:
        print("skip", name, type(e).__name__, e); del objs[name]
with open(sys.argv[1], "wb") as f:
    pickle.dump(objs, f, protocol=4)
print(sorted(objs))
