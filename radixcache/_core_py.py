"""Pure-Python radix tree core: the reference, the fallback and the benchmark baseline.

The compiled core (``_core_c.pyx``) implements exactly this interface; ``cache.py`` talks to
whichever one ``_core.py`` chose and never walks the tree itself. ``_contract.py`` states the
interface as typing Protocols (checked against both cores by the tests). This core keeps its
tree (``Guard``, ``Node``, ``Tree``) in ``_tree_py`` and its heap (``EvictionHeap``) in
``_heap_py``; this module holds ``Core`` and ``put_slots`` and exports them all.

Interface shared by both cores
------------------------------
``Core(page_size, policy, host_tier=False, write_through_hits=0, numpy_arrays=False)`` -- one
per cache: the tree, the eviction heap(s), the sizes and the counters, and every per-call
operation, each one call into the core. The host tier (``host_tier``; see "Host tier" below) is
off by default; without it everything below behaves, and costs, as in a one-tier cache.
``cache.py`` keeps the public class, input validation (the slow path), device tensors, the
events hook and stats assembly.

Index arrays. Every index array a core makes -- ``MatchResult.indices`` (a miss's too),
``Node.value``/``stored_value``/``host_value``, what ``free_callback`` and ``backup`` get (one
array per node, or the batch), ``load_back``'s result -- is a new, writable 1-D int64 array
the caller owns (except a node's device value, which ``Node.value`` hands out as kept, as a
new view: its data is the node's, its shape the caller's): with
``numpy_arrays`` false (the default) a ``torch.int64`` tensor, on the CPU unless made of
device values; with ``numpy_arrays`` a ``numpy.ndarray`` of dtype int64. In the first mode
the constructor imports torch (``_torch.load_torch``); in the second the core never does.
Its read-only attribute ``numpy_arrays`` says which. A core of numpy arrays holds CPU values
only: cache.py keeps device tensors away from it, its ``set_value`` and ``load_back`` take
int64 numpy arrays (``TypeError`` otherwise), ``backup`` must answer a numpy array (see "Host
tier") and ``import_state`` refuses a state holding device tensors (``ValueError``).
Importing this module imports no torch: its torch names are bound through
``_torch.on_torch`` once some code loads torch; until then nothing counts as a tensor, so a
tensor input (which needs torch imported: cache.py's checks then bind it) takes the unusual
input way below, and after that the fast paths take it in either mode.

The fast-path contract: ``match``, ``insert`` and ``exists`` accept the common inputs --
tokens as a list or tuple of ints, a 1-D int64 numpy array, ``array('q')`` or a 1-D CPU int64
torch tensor (once torch is bound); ``kv`` as None, such a tensor, array or ``array('q')``, or
a list/tuple of ints; a hashable ``extra_key``; an ``int`` priority in int64 -- and return
their result. For anything else, or any input that would fail, they return ``None`` having
changed nothing; ``cache.py`` then takes the guard (``enter(what)``/``leave()``), validates in
Python (raising the documented exception) and calls again with canonical inputs and
``held=True``: tokens as a 1-D int64 numpy array, CPU kv as a 1-D int64 numpy array (device
values go through ``set_value`` afterwards). A call with canonical inputs never returns None.

- ``match(tokens, extra_key, held=False) -> MatchResult | None``: the longest cached
  page-aligned prefix; splits the node where it ends inside one; stamps the path with one
  clock tick (none when the aligned length is 0); counts a lookup and the queried/matched
  tokens; for policies in ``KEY_FALLS_ON_ACCESS`` pushes the matched leaf again. ``indices``
  is one new index array (a new empty one on a miss, with ``last_node`` the root).
- ``insert(tokens, kv, extra_key, priority, held=False, hits_from=0) -> InsertResult |
  None``: walks, splits where the key diverges inside a node, adds the uncached remainder as
  one new leaf (with ``held``, ``take_new_leaf()`` returns it afterwards) holding a copy of its
  slice of ``kv``, stamps the path, raises priorities, counts one hit per path node that ends
  past ``hits_from`` tokens (an int in [0, 2^63); a new leaf starts at 1 if it ends past
  ``hits_from``, else at 0; the default 0 counts every node),
  marks the last node terminal when the sequence was page aligned, updates sizes and
  counters and pushes the new leaf on the heap. ``split_at`` (None, or an int: a multiple of
  the page size, at most the aligned length) then does, in the same call, what a second
  ``insert(tokens[:split_at], None, extra_key, split_priority, hits_from=split_at)`` would:
  splits the node the prefix ends inside, stamps the prefix's path with a new clock tick,
  raises its priorities to ``split_priority`` (an int64), marks its last node terminal and
  counts one more insert; the result is the sequence's. ``ValueError`` with a host tier
  (cache.py makes the two calls there).
- ``exists(tokens, extra_key, held=False) -> bool | None``: read-only exact-sequence test.
- ``token_array(tokens) -> numpy.ndarray | None``: the common token inputs as a new int64
  array (None otherwise), for cache.py's validation path.
- ``walk(tokens, extra_key) -> int``: read-only longest cached page-aligned prefix length (no
  split, no stamps, no counters): the bare tree walk that the benchmarks time.
- ``lock(node, delta, held=False) -> int``: ``delta`` +1 or -1; walks node -> root (root
  excluded: its ``lock_ref`` is a permanent 1, as in SGLang, and locking or unlocking the
  root itself is a no-op returning 0), moves the tokens that crossed between unlocked and locked
  between ``evictable`` and ``protected`` and returns their count; an unlock that makes the node an
  evictable leaf pushes it. ``TypeError`` for a non-node, ``ValueError`` for an evicted node,
  a node of another tree or an unlock below 0, and ``OverflowError`` for a lock past
  ``MAX_LOCK_REF`` (2^31 - 1) on any node of the path, changing nothing.
- ``set_rank(node, rank, held=False)``: the node's eviction rank, an ``int`` in [0, 2^63)
  (0 for every node until set): the heap's sort key is (rank, the policy's key), so every
  evictable leaf of a lower rank goes before any of a higher rank, and the policy orders
  each rank. The rank stays with the node object (a split's lower half; the new upper half
  has rank 0) until it is set again or the node leaves the tree (evicted, ``remove_leaf``,
  ``reset``); a lowered rank pushes the node if it is an evictable leaf (a rise needs no push:
  the heap is lazy). ``TypeError`` for a non-node or a rank that is not an int (bool
  included), ``ValueError`` for a rank out of range, the root, an evicted node, a node of
  another tree, or a core with a host tier, changing nothing. ``EvictionHeap.rank_of(node)``
  reads it (0 when none was set).
- Session tags: a session is an ``int`` in [0, 2^63) (else ``TypeError``/``ValueError``), a
  tagged node's rank its number of sessions. ``tag_session(node, session, held=False) -> bool``:
  tags ``node``; the nearest ancestor ``session`` tagged loses its tag; False, changing nothing,
  for a tagged node or the root; checked as ``set_rank``. ``untag_session(session, held=False)
  -> int``: drops its tags (returns how many). A tagged node leaving the tree (evicted,
  ``remove_leaf``, ``revert_insert``) gives its tags to its parent (not the root), whose rank
  becomes its tag count (over ``on_remove``'s) before it can be pushed. ``session_tags(node)``,
  ``tagged_nodes(session)`` read them; ``reset`` drops them; a split keeps them on the node.
- ``pop_victim(held=False) -> Node | None`` and ``remove_leaf(node, held=False) -> int``
  (tokens freed): the evict loop's two steps; ``remove_leaf`` detaches the leaf (ValueError
  for a node of another cache, or not an attached leaf), marks it evicted, drops its value and
  rank, counts the eviction and pushes the parent if it became an evictable leaf.
- ``evict(num_tokens, free_callback=None, batch=False, on_remove=None) -> int``: the whole evict
  loop in one call (never ``held``: it takes the guard itself). Pops victims and removes them as
  the two steps above until ``num_tokens`` are freed or none is left; returns the tokens freed.
  ``on_remove(node)`` (cache.py's events hook) runs under the guard for each victim before it is
  detached; if it raises, or the victim is no longer an evictable leaf after it
  (``RuntimeError``), the victim stays (pushed back) and the exception propagates. It may return
  the rank the victim's parent takes (an int in [0, 2^63); None: the parent's rank stays;
  ignored when the parent is the root), set before the parent can be pushed, so that a parent
  that becomes an evictable leaf in the same call competes with its new rank (an owner whose
  ranks say what a leaf's removal leaves to its parent keeps them exact this way); anything else
  raises ``TypeError`` or ``ValueError`` with the victim left as it was. Per node (``batch``
  false), each victim's index array (a new one, as a match's) goes to ``free_callback`` once the
  victim is detached and counted, with the guard released around the call: the callback may call
  the cache; if it raises, the victims detached so far stay evicted and counted and the
  exception propagates; the loop re-takes the guard after it (``RuntimeError`` if another call
  holds it then). With ``batch``, ``free_callback`` is called once, after the loop and outside
  the guard, with the victims' indices concatenated in eviction order (one new array; not called
  when nothing was freed), also when the loop stops on an exception (which it then re-raises):
  freed indices are never lost. No node, pointer or size read before a callback is trusted after
  it. ``evict(..., page_ids=True)`` (with ``batch`` and without a host tier, else ``ValueError``
  before anything runs): the batch holds each victim's page ids instead of its indices (every
  ``page_size``-th index from its first, floor-divided by ``page_size``: what a paged allocator
  frees), in the same order (``_handover.page_ids``).
- ``set_value(node, values, held=False)``: a fresh leaf's device values (kept as given; with
  ``numpy_arrays``, an int64 numpy array of the node's length, copied in).
- ``export_state() -> dict`` and ``import_state(state)``: copies and pickles of a cache.
  ``export_state`` returns plain data: ``nodes``, a list with one tuple per node (root
  excluded), every parent listed before its children, of the fields ``NODE_FIELDS``
  (``_state``): the parent's position in the list (-1: the root), the key as int64 bytes,
  the value (None when the key doubles as the indices, int64 bytes for CPU values, a copy of
  the node's part of a device tensor), ``extra_key``, ``priority``, ``last_access_time``,
  ``created_time``, ``hit_count``, ``terminal`` and ``id``; then ``clock``, ``num_splits``,
  ``empty_inserted`` (a list) and ``counters`` (``COUNTER_FIELDS``). Lock counts are not
  carried. ``import_state`` rebuilds such a state (from either core) into an empty core:
  every node unlocked, so all of it evictable, and every leaf on the heap; the new nodes get
  fresh ids in the order of the saved ones, so eviction order (ties included) is the saved
  cache's. A malformed state raises ``ValueError`` (``_state.check_state`` validates it
  before any change) and a non-empty core ``ValueError``.
- ``reset(held=False)``, ``reset_stats()``; attributes ``tree``, ``heap``, ``guard``,
  ``evictable``, ``protected``, ``lookups``, ``matched_tokens``, ``queried_tokens``,
  ``inserts``, ``inserted_tokens``, ``evictions``, ``evicted_tokens``.

Host tier
---------
With ``host_tier`` a node holds a device value (its KV slots on the GPU), a host value (slots
in the engine's host pool, kept as int64 bytes; a split slices it as it slices a CPU device
value), or both. The core owns no pool and copies no data.

- Node: ``on_device`` (always True without a host tier; a host-only node has ``value`` and
  ``stored_value`` None but is not ``evicted``), ``host_value`` (a new CPU index array,
  or None), ``tier`` (``"device"``, ``"host"`` or ``"device+host"``).
- Node kinds: the nodes of a tree with a host tier are ``HostNode`` objects (a subclass of
  ``Node``, exported by both core modules, carrying the host tier's fields); a one-tier tree
  makes plain ``Node`` objects, which have no room for them (so a one-tier cache pays
  nothing per node for the host tier). A call given a node of another cache (whatever its
  kind) refuses it or, for ``revert_insert``, leaves it alone.
- Invariants: every node but the root has a device or a host value; no node on the device
  below a host-only node; a locked node is on the device; ``evictable + protected`` = tokens
  on the device; ``host_size`` = tokens with a host copy.
- A device leaf: on the device, not the root, not evicted, unlocked, no child on the device
  (host-only children allowed). ``heap`` holds device leaves; its lazy validity check is that
  predicate. A host leaf: host only, not evicted, no children at all; ``host_heap`` (same
  class, policy and guard) holds them.
- ``write_through_hits``: 0 (``write_back``: nothing is due for write-through), 1
  (``write_through``) or 2 (``write_through_selective``). Attributes ``host_tier``,
  ``write_through_hits``, ``host_heap``, ``host_size`` and the counters ``host_hit_tokens``,
  ``loaded_tokens``, ``backed_up_tokens``, ``host_evictions``, ``host_evicted_tokens``
  (zeroed by ``reset_stats``; ``reset`` also drops every host value and the queue).
- ``match``: ``indices``/``length``/``last_node`` cover the device nodes of the path (a prefix
  of it); the walk goes on through host-only nodes (splitting one where the match ends inside
  it). ``MatchResult.host_length``: the tokens of that host-only continuation;
  ``last_host_node``: where it ends (``last_node`` when ``host_length`` is 0). Every node of the
  path gets the call's clock tick; ``matched_tokens += length``, ``host_hit_tokens +=
  host_length``. For ``KEY_FALLS_ON_ACCESS`` policies the host leaf it ends on is pushed on
  ``host_heap`` too. ``walk`` counts the device prefix only; ``exists`` sees either tier.
- ``insert``: each host-only node of the walked path is adopted, top-down: it takes the
  caller's slots for its tokens (its slice of ``kv``, or the key when ``kv`` is None), is on
  the device again (keeping its host copy) and ``evictable`` grows by its tokens. ``prefix_len``
  counts only the tokens that were on the device before the call. With device values (a tensor not
  on the CPU) cache.py makes the core call ``held`` with ``kv`` None, then copies each adopted
  node's and the new leaf's slice on the caller's device and stores them with ``set_value``;
  if any of that raises (a device out of memory, a torch hook), it calls
  ``revert_insert(adopted, new_leaf, held=True)`` before the error propagates: the new leaf
  leaves the tree (``evictable`` and ``inserted_tokens`` shrink back) and the adopted nodes
  are host only again (``evictable`` shrinks back; a childless one goes back on
  ``host_heap``), so no node keeps its token ids as KV slots. Access times, hit counts,
  priorities, splits and the ``inserts`` count of the walk stay, as after any insert.
  ``revert_insert`` skips a node that is no longer as the insert left it. With ``held``,
  ``take_adopted()`` returns (and forgets) the adopted ``(node, start)`` pairs, ``start`` the
  offset of the node's first token in the sequence; ``set_value`` accepts them (device
  values). With ``write_through_hits > 0``, the path's nodes and the new leaf that are on the
  device, have no host copy, are not queued and have ``hit_count >= write_through_hits`` are
  appended to the write-through queue, top-down; a split of a queued node appends its new
  upper half.
- ``evict(num_tokens, free_callback=None, batch=False, on_remove=None, backup=None, on_backup=None,
  free_host=None, on_remove_host=None, keep=None)``: (a core with a host tier has no ranks: what
  ``on_remove`` returns is ignored) for each victim (a device leaf) not in ``keep`` (a container of
  nodes tested with ``in``; a device leaf in it is passed over as a skipped one is, below): (1)
  with a host copy it is demoted: ``on_remove(node)``, then its device value is dropped
  (``on_device`` False, ``evictable``, ``evictions`` and ``evicted_tokens`` as for a removal); it
  stays in the tree and goes on ``host_heap`` if childless. (2) Else, with ``backup`` and
  ``write_through_hits == 0``, ``backup(device_indices)`` runs under the guard (``device_indices``:
  the array ``free_callback`` gets; with ``batch``, the victim's part of the batch: what backup
  writes in it during the call shows in the batch, and an array it keeps may share the batch's
  memory); it returns None (the host is full) or host indices, checked by
  ``_handover.host_indices_bytes`` (a 1-D ``torch.int64`` tensor of exactly the node's length, any
  device; with ``numpy_arrays`` a 1-D int64 numpy array of that length; TypeError or ValueError
  otherwise); a valid one becomes the host value (``host_size`` and ``backed_up_tokens`` grow),
  ``on_backup(node)`` runs and the node is demoted as in (1). Any error raised after ``backup``
  returned a non-None answer and before the node keeps it (the checks, a torch hook while they read
  it, the compiled core's check that the node did not change meanwhile) is raised with the
  attribute ``host_indices`` set to that answer as returned (``_handover.answer_not_kept``: an
  exception that takes no attribute is replaced by a ``RuntimeError`` carrying it): the answer's
  host slots were not kept and go back to the engine. An error from ``backup`` itself gets no such
  attribute. (3) Else it is deleted as without a host tier -- unless it has (host-only) children:
  then, without ``free_host``, it is skipped, left unchanged, and pushed back on ``heap`` when the
  loop ends. With ``free_host``, its descendants (all host only) leave the tree first, bottom-up,
  each as a host leaf leaves (below), and the victim is deleted: every victim leaves the device, so
  the device's eviction order does not depend on the host. A host leaf leaves as in ``evict_host``:
  ``on_remove_host(node)``, then it is detached and counted (``host_size``, ``host_evictions``,
  ``host_evicted_tokens``), then ``free_host`` gets its host indices (a new CPU index array), under
  the guard, like ``backup`` (it must not call the cache). With ``free_host`` and ``backup``, a
  ``backup`` that returns None is followed by host leaves leaving, one at a time in ``host_heap``'s
  policy order (passing over, and leaving on the heap, the host leaves in ``keep``), ``backup``
  asked again after each, until it answers or no host leaf is left (SGLang evicts the node's size
  from the host and retries once; this frees no more than the copy needs); a victim that would
  leave with a host-only subtree holding a node in ``keep`` is skipped instead. If ``free_host`` or
  ``on_remove_host`` raises, the nodes that left so far stay gone, the victim stays (pushed back)
  and the exception propagates. A skipped node is skipped for the rest of the call, even if a
  callback (a per-node ``free_callback`` that calls the cache) pushes it on ``heap`` again
  meanwhile: ``backup`` is asked about a victim once per call (with ``free_host``, once more per
  host leaf that left to make room for it); the next call asks again. If ``backup``, ``on_backup``
  or ``on_remove`` raises (or ``backup`` returns a bad value), the victim stays (pushed back; a
  host copy it got stays) and the exception propagates. The device slots of every victim that left
  go to ``free_callback`` as without a host tier; a parent that became a device leaf is pushed (it
  can follow in the same call).
- ``evict_host(num_tokens, free_callback=None, batch=False, on_remove=None, keep=None) ->
  int``: host tokens freed, host leaves in policy order, passing over (and leaving on
  ``host_heap``) those in ``keep``: ``on_remove(node)`` (if it raises, the victim
  stays and the exception propagates), the node is detached and marked evicted, ``host_size``
  shrinks, ``host_evictions``/``host_evicted_tokens`` count it, its host indices (a new CPU
  index array) go to ``free_callback`` exactly as ``evict`` hands device indices (per node
  with the guard released, or batched). A parent left host-only and childless is pushed on
  ``host_heap``.
- ``write_through(backup, on_backup=None) -> int``: tokens copied. Takes the queue in FIFO
  order, dropping entries that are evicted, not on the device or already copied. For each
  other one ``backup(device_indices)`` runs under the guard. None means "no room for
  this node now": it stays queued, in its place, and is asked about again on a later call;
  the call goes on with the nodes behind it, but does not ask about one at least as large
  as the smallest node refused in this call (it is skipped the same way; after a refused
  node of ``page_size`` tokens the call ends), so one large node never holds up the copies
  queued behind it; an exception or a bad value (same checks as ``evict``, and an
  error after the answer carries it in ``host_indices`` as there) leaves the node at the
  front and propagates; a valid answer becomes its host value (``host_size``,
  ``backed_up_tokens``) and ``on_backup(node)`` runs. The node stays on the device.
- ``load_back(match, device_values, on_load=None) -> index array``: ``match`` must be a
  ``MatchResult`` whose host continuation is still exactly there (from ``last_host_node`` up to,
  excluding, ``last_node``: in this tree, not evicted, host only, parent by parent, their
  tokens summing to ``host_length``; ``last_node`` the root or on the device), else
  ``ValueError("stale match: ...")``. ``device_values`` (cache.py validated it: a 1-D int64
  numpy array or tensor; with ``numpy_arrays`` a numpy array) must hold ``host_length``
  entries (ValueError). The nodes, top-down, take their slices (a CPU array as int64 bytes, a
  tensor kept), are on the device again (``evictable`` grows) and the deepest is pushed on
  ``heap`` if a device leaf; ``loaded_tokens += host_length``; then ``on_load(node)`` runs for
  each, top-down. Returns their host indices, top-down, as one new CPU index array (empty for
  ``host_length`` 0).
- ``next_victim(host=False, keep=None) -> Node | None``: the node ``evict`` (``host``:
  ``evict_host``) would take first, passing over the nodes in ``keep``; the heap keeps every
  live entry it looked at (only stale entries are dropped, as a pop drops them).
- ``back_up(node, host, on_backup=None)``: ``node`` (of this tree, not evicted: else
  TypeError/ValueError as for ``lock``) is not the root and is on the device without a host
  copy (else ValueError); ``host`` is checked as ``backup``'s answer in ``evict`` and becomes
  its host value (``host_size``, ``backed_up_tokens``), then ``on_backup(node)`` runs under
  the guard.
  The engine's write-through of one node, when it decides which and when.
- ``drop_host_copy(node, on_remove_host=None) -> index array``: ``node`` (checked as in
  ``back_up``) is on the device with a host copy (else ValueError); ``on_remove_host(node)``
  runs under the guard (if it raises, nothing changed), then the host value is dropped
  (``host_size`` shrinks) and returned as a new CPU index array. The node stays on the device.
- ``insert_host(node, tokens, host, extra_key=None, refill=False, on_store=None) ->
  (prefix_len, last_node, unused, dropped)``: pages that arrived in host slots (fetched from
  storage) go into the tree below ``node`` (of this tree, not evicted, the root allowed: else
  TypeError/ValueError as for ``lock``). ``tokens`` (the pages after ``node``'s path; a whole
  number of pages, else ValueError) and ``host`` (one host index per token, else ValueError)
  are token inputs (else TypeError); ``extra_key`` is the namespace at the root (below it, the
  node's own; unhashable: TypeError). Nothing changes on any of these errors. The walk from
  ``node`` stamps ``node`` (no tokens: ``node`` alone, as SGLang's empty ``insert_host``
  touches its anchor) and every node it passes with one clock tick and splits a node
  where the pages end or differ inside it (a split of a queued node queues its upper half);
  for ``KEY_FALLS_ON_ACCESS`` policies the deepest node on the device it stamped is pushed
  on ``heap`` if a device leaf, and the node it ends on on ``host_heap`` if a host leaf.
  Each node passed: with ``refill`` and no host copy (on the device only) it takes its slice
  of ``host`` as its host copy (``host_size`` grows); else its slice is unused and its tokens
  count in ``prefix_len``. Then the pages left, if any: with ``refill`` below a node that is
  not the root and has no host copy (the walk ended on ``node``) they are all dropped
  (``dropped`` True, ``prefix_len`` 0, all of ``host`` unused); else they become one new
  host-only node (no device value, ``node``'s priority, the call's tick, not terminal, pushed
  on ``host_heap``; ``host_size`` grows). ``last_node``: the new node, else the last node the
  walk reached (``node`` if none). ``unused``: a new CPU index array of the host slots the
  tree did not take, in token order (the caller frees them; ``prefix_len`` of them unless
  dropped). Then ``on_store(node)`` runs for each node given host slots, top-down (the tree
  is complete by then; an error from it propagates). SGLang's ``insert_host`` of a prefetch:
  ``refill`` is its write-through rule (every policy but ``write_back``).
- ``lock(node, +1)`` on a host-only node raises ValueError (load it back first), changing
  nothing.
- ``export_state`` raises TypeError with a host tier (cache.py refuses to pickle or copy
  such a cache first).

The tokens are read once per call, at its start, before it runs any other Python code (the
extra_key's hashing): a call sees them as they were when it began.

``Node`` -- one tree node. Public, read-only properties: ``key`` (read-only 1-D int64 numpy
array of the node's tokens), ``num_tokens``, ``stored_value`` (the index array given at
insert, or None when the key doubles as the indices or the node was evicted), ``parent``,
``children`` (tuple of nodes), ``num_children``, ``lock_ref``, ``last_access_time``,
``created_time``, ``priority``, ``hit_count``, ``extra_key``, ``id``, ``evicted``,
``terminal``, and ``value`` (the index array, materialised from the key when none was
stored, None once evicted). A node cannot be pickled or copied (``TypeError``: pickle or
copy the cache) nor weakly referenced, on either core.

``Tree`` (``Core.tree``) -- attributes ``root``, ``page_size``, ``clock`` (logical time, +1 per
touching call), ``node_count`` (nodes excluding the root), ``num_splits``, ``guard``;
``iter_nodes() -> iterator of (node, depth)``: pre-order, root first at depth 0, siblings in
``display_order`` (so both cores list a tree identically); ``check_layout()`` raises
``AssertionError`` naming the node whose child lookup structure is inconsistent (each core
checks its own layout; for tests). Its walks are the core's own.

``EvictionHeap`` (``Core.heap``) -- the lazy eviction heap (policy names as in
``EVICTION_POLICIES``) sharing the tree's guard: ``push(node)``, ``pop_victim()``, ``len()``,
``clear()`` (the entries; ranks stay), ``rank_of(node)``, ``key_of(node)`` (rank included) and
``entries()`` (list of (stored key, node)) for consistency checks; see the class docstring.

``put_slots(stack, top, slots, bound) -> int`` -- a module function, not part of the tree:
a slot pool's free-list push. ``stack`` is the pool's free stack (a writable 1-D contiguous
int64 ``numpy.ndarray``, its free ids in ``stack[:top]``); ``slots`` the ids to push (an int64
``numpy.ndarray`` or CPU ``torch.int64`` tensor, 1-D contiguous). When every id lies in ``[0,
bound)`` and ``top + len(slots) <= min(bound, len(stack))`` (a pool never holds more free ids
than it has), they are copied to ``stack[top:]`` and the call returns how many; otherwise it
returns -1 and the entries that count, ``stack[:top]``, are as they were (it may write above
``top``). It also declines, with -1, another input type, dtype or layout and a torch
function mode, and the compiled core ids that share memory with the entries written: the
pool then takes its own checked path, which gives the errors. ``slots`` may also be an
``array.array`` of int64 (typecode ``q``, or ``l`` where it has 8 bytes); ``top`` and
``bound`` beyond int64 raise ``OverflowError``. ``KVPool.free`` and
``HostPool.free`` use the compiled core's (this one is its reference: in Python the pools'
own numpy path is faster).

The block index and the page hashes (``BlockIndex``, ``page_hash_chain``,
``page_hash_bytes``) are not part of the tree: ``_blocks_py`` specifies them.

Re-entrancy: the ``Guard`` is held for the duration of every ``Core`` call (and of every
public tree or heap call). A call into the cache while another runs -- from a token's
``__index__``, an extra_key's ``__hash__``/``__eq__``, a torch hook, a finalizer, or another
thread -- raises ``RuntimeError`` ("RadixCache re-entered ...") and changes nothing.
References a call drops (an evicted leaf's value, stale heap entries, a cleared heap) are
released after the guard, when the structure is consistent, so finalizers they set off may
call the cache. ``iter_nodes`` holds no guard (it is a generator; it holds references to
what it has yet to yield). A split writes the tree only after its last call out: the
compiled core shares a device value between the halves through an offset and calls
nothing; this core slices it first (a view of the same storage), so a torch hook that
raises leaves the tree unchanged. Nodes own their children, key, value and ``extra_key``
and are visible to the garbage collector; freeing a tree never recurses.
"""

from __future__ import annotations

import array
import struct
from collections import deque
from typing import Any

import numpy as np

# A BlockIndex pickled while the block index lived in this module names its loader here.
from ._blocks_py import _block_index_from  # noqa: F401 -- the loader old pickles name
from ._errors import bad_rank, bad_session, cpu_values_only, rank_needs_one_tier, reentered
from ._handover import hand_over_batch
from ._handover import page_ids as page_ids_of
from ._heap_py import EvictionHeap, device_leaf, host_leaf
from ._host_py import HostTier
from ._options import KEY_FALLS_ON_ACCESS
from ._state import check_state, id_order
from ._torch import cat_tensors, empty_indices, indices_from_key, load_torch, on_torch
from ._tree_py import TOKEN_BYTES, Guard, HostNode, Node, Tree, index_array
from ._types import InsertResult, MatchResult
from ._validate import INT64_MAX, INT64_MIN

__all__ = ["Core", "Guard", "Node", "HostNode", "Tree", "EvictionHeap", "CORE_NAME",
           "put_slots"]

CORE_NAME = "python"


class _NoTensor:
    """Stands in for ``torch.Tensor`` until torch is bound: nothing is an instance of it, so
    a tensor input before then takes the unusual-input way (cache.py's checked path)."""

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("the stand-in for torch.Tensor has no instances")


# The torch names this module uses, bound once some code imports torch (``_bind_torch``).
_torch: Any = None
_Tensor: Any = _NoTensor
_int64: Any = None


def _bind_torch(torch: Any) -> None:
    global _torch, _Tensor, _int64
    _torch = torch
    _Tensor = torch.Tensor
    _int64 = torch.int64


on_torch(_bind_torch)


def _token_bytes(tokens: Any) -> bytes | None:
    """The common token inputs as one native int64 byte string (one conversion per call):
    a list or tuple of ints, a 1-D int64 numpy array, ``array('q')`` or a 1-D CPU int64
    tensor. None for anything else, or when a conversion fails: cache.py's checks take over."""
    kind = type(tokens)
    if kind is list or kind is tuple:
        try:
            return struct.pack(f"{len(tokens)}q", *tokens)
        except struct.error:
            return None
    if kind is np.ndarray:
        if tokens.dtype == np.int64 and tokens.ndim == 1:
            return tokens.tobytes()
        return None
    if kind is array.array:
        return tokens.tobytes() if tokens.typecode == "q" else None
    if kind is _Tensor:
        # The type's methods, not the instance's: an attribute set on a tensor shadows them.
        if tokens.is_cpu and tokens.dtype is _int64 and _Tensor.dim(tokens) == 1:
            return _Tensor.numpy(tokens).tobytes()
    return None


def _kv_array(kv: Any, needed: int) -> np.ndarray | None:
    """The common kv_indices inputs as a 1-D int64 array of at least ``needed`` entries (a
    view where possible; the core copies the new leaf's slice). None for anything else."""
    kind = type(kv)
    if kind is _Tensor:
        if not kv.is_cpu or kv.dtype is not _int64 or _Tensor.dim(kv) != 1:
            return None
        arr = _Tensor.numpy(kv)
    elif kind is np.ndarray:
        arr = kv
    elif kind is array.array:
        if kv.typecode != "q":
            return None
        arr = np.frombuffer(kv, dtype=np.int64) if len(kv) else np.empty(0, dtype=np.int64)
    elif kind is list or kind is tuple:
        try:
            arr = np.array(kv)
        except (OverflowError, ValueError, TypeError):
            return None
    else:
        return None
    if arr.dtype != np.int64 or arr.ndim != 1 or arr.shape[0] < needed:
        return None
    return arr


def _hashable(extra_key: Any) -> bool:
    try:
        hash(extra_key)
    except TypeError:
        return False
    return True


def _joined_values(parts: list) -> Any:
    """Evicted nodes' values (int64 bytes, or device tensors) as one new int64 tensor."""
    if all(type(part) is bytes for part in parts):
        return index_array(parts, False)
    return cat_tensors([indices_from_key(np.frombuffer(part, dtype=np.int64))
                        if type(part) is bytes else part for part in parts])


def _joined_arrays(parts: list) -> np.ndarray:
    """``_joined_values`` for a core of numpy arrays: the parts are int64 bytes or the numpy
    arrays ``backup`` got (read now: what it wrote in them shows), all on the CPU."""
    return index_array([part if type(part) is bytes else np.ndarray.tobytes(part)
                         for part in parts], True)


# -- the per-cache core object -------------------------------------------------------------
class Core(HostTier):
    """One cache's tree, eviction heap, sizes and counters, and its whole-call operations.

    Every call holds the tree's guard (shared with the heap) unless ``held`` says the caller
    (cache.py's validation path) holds it already. References a call lets go are
    released after the guard."""

    __slots__ = ("tree", "heap", "guard", "page_size", "evictable", "protected", "lookups",
                 "matched_tokens", "queried_tokens", "inserts", "inserted_tokens", "evictions",
                 "evicted_tokens", "new_leaf", "_push_on_access", "_enter", "_leave",
                 "host_tier", "write_through_hits", "host_heap", "host_size", "_node_tags",
                 "host_hit_tokens", "loaded_tokens", "backed_up_tokens", "host_evictions",
                 "host_evicted_tokens", "adopted", "_numpy_arrays", "_join", "_session_nodes")

    def __init__(self, page_size: int, policy: str, host_tier: bool = False,
                 write_through_hits: int = 0, numpy_arrays: bool = False) -> None:
        if type(write_through_hits) is not int or write_through_hits not in (0, 1, 2):
            raise ValueError(f"write_through_hits must be 0, 1 or 2, got "
                             f"{write_through_hits!r}")
        numpy_arrays = bool(numpy_arrays)
        if not numpy_arrays:
            load_torch()  # index arrays are tensors: torch is imported and bound here
        self._numpy_arrays = numpy_arrays
        self._join = _joined_arrays if numpy_arrays else _joined_values
        self.page_size = page_size
        self.tree = self._make_tree(page_size, numpy_arrays, bool(host_tier))
        self.guard = self.tree.guard
        self._enter = self.guard.acquire
        self._leave = self.guard.release
        self.host_tier = bool(host_tier)
        self.write_through_hits = write_through_hits if self.host_tier else 0
        self.heap = EvictionHeap(policy, self.guard, device_leaf if self.host_tier else None)
        self.host_heap = EvictionHeap(policy, self.guard, host_leaf)
        self._push_on_access = policy in KEY_FALLS_ON_ACCESS
        self.evictable = 0
        self.protected = 0
        self.host_size = 0
        self.new_leaf = None
        self.adopted = None
        self._node_tags, self._session_nodes = {}, {}  # node -> its sessions; session -> nodes
        self.reset_stats()

    @property
    def numpy_arrays(self) -> bool:
        """Whether the index arrays this core makes are numpy arrays (else tensors)."""
        return self._numpy_arrays

    def _make_tree(self, page_size: int, numpy_arrays: bool, host_tier: bool) -> Tree:
        return Tree(page_size, numpy_arrays, host_tier)

    # -- the guard, for cache.py's slow paths -----------------------------------------
    def enter(self, what: str) -> None:
        if not self._enter(False):
            raise reentered(what)

    def leave(self) -> None:
        self._leave()

    def _take(self, held: bool, what: str) -> None:
        if not held and not self._enter(False):
            raise reentered(what)

    def reset_stats(self) -> None:
        self.lookups = self.matched_tokens = self.queried_tokens = 0
        self.inserts = self.inserted_tokens = self.evictions = self.evicted_tokens = 0
        self.host_hit_tokens = self.loaded_tokens = self.backed_up_tokens = 0
        self.host_evictions = self.host_evicted_tokens = 0
        self.tree.num_splits = 0

    def reset(self, held: bool = False) -> None:
        self._take(held, "reset")
        try:
            old_root = self.tree._clear()  # noqa: F841 -- released after the guard
            old_queue = self.tree._queue  # noqa: F841 -- held until the call returns
            self.tree._queue = deque()
            old_entries = [self.heap._clear_ranks(), self._node_tags, self._session_nodes]
            self._node_tags, self._session_nodes = {}, {}
            for heap in (self.heap, self.host_heap):
                old_entries.append(heap._nodes)
                heap._heap = []
                heap._nodes = {}
                heap._limit = 1024
            self.evictable = 0
            self.protected = 0
            self.host_size = 0
            self.new_leaf = None
            self.adopted = None
            self.reset_stats()
        finally:
            if not held:
                self._leave()

    def _push_if_evictable(self, node: Node) -> Any:
        if self.host_tier:
            if node is not self.tree.root and device_leaf(node):
                return self.heap._push(node)
            return None
        if (not node._children and not node._lock_ref and not node._evicted
                and node is not self.tree.root):
            return self.heap._push(node)
        return None

    # -- whole calls -----------------------------------------------------------------------
    def insert_host(self, node: Any, tokens: Any, host: Any, extra_key: Any = None,
                    refill: bool = False, on_store: Any = None) -> tuple:
        """Insert host-only pages below ``node``; see the module docstring."""
        return self._insert_host(node, _token_bytes(tokens), _token_bytes(host),
                                 (type(tokens).__name__, type(host).__name__), extra_key,
                                 _hashable, bool(refill), on_store)

    def match(self, tokens: Any, extra_key: Any = None, held: bool = False) -> MatchResult | None:
        self._take(held, "match_prefix")
        try:
            buf = _token_bytes(tokens)  # first: the tokens as they were when the call began
            if buf is None or (extra_key is not None and not _hashable(extra_key)):
                return None
            tree = self.tree
            path, length = tree._match(buf, extra_key)
            self.lookups += 1
            n = len(buf) // TOKEN_BYTES
            self.queried_tokens += n - n % self.page_size
            if not path:
                return MatchResult(empty_indices(self._numpy_arrays), tree.root, 0)
            if self.host_tier:
                return self._tiered_match(path, length)
            self.matched_tokens += length
            last = path[-1]
            if self._push_on_access:
                dropped = self._push_if_evictable(last)  # noqa: F841 -- held until the call returns
            return MatchResult(tree._gather(path), last, length)
        finally:
            if not held:
                self._leave()

    def _tiered_match(self, path: list, length: int) -> MatchResult:
        """A match's result with a host tier: the device part of ``path``, then its host-only
        continuation (the device nodes form a prefix of the path by the tier invariant)."""
        tree = self.tree
        cut = len(path)
        for i, node in enumerate(path):
            if not node._on_device:
                cut = i
                break
        device = path[:cut]
        device_length = 0
        for node in device:
            device_length += node.num_tokens
        host_length = length - device_length
        self.matched_tokens += device_length
        self.host_hit_tokens += host_length
        last = device[-1] if device else tree.root
        last_host = path[-1] if host_length else None
        if self._push_on_access:
            dropped = self._push_if_evictable(last)
            if last_host is not None and host_leaf(last_host):
                dropped = self.host_heap._push(last_host)  # noqa: F841 -- held until the call returns
        indices = tree._gather(device) if device else empty_indices(self._numpy_arrays)
        return MatchResult(indices, last, device_length, host_length, last_host)

    def insert(self, tokens: Any, kv: Any = None, extra_key: Any = None, priority: Any = 0,
               held: bool = False, hits_from: Any = 0, split_at: Any = None,
               split_priority: Any = 0) -> InsertResult | None:
        if type(priority) is not int or not INT64_MIN <= priority <= INT64_MAX:
            return None
        if type(hits_from) is not int or not 0 <= hits_from <= INT64_MAX:
            return None
        if split_at is not None:
            if (type(split_at) is not int or type(split_priority) is not int
                    or not 0 <= split_at <= INT64_MAX or split_at % self.page_size
                    or not INT64_MIN <= split_priority <= INT64_MAX):
                return None
            if self.host_tier:
                raise ValueError("insert: split_at is not taken by a core with a host tier")
        self._take(held, "insert")
        try:
            if kv is not None and type(kv) is _Tensor and not kv.is_cpu:
                return None  # values on a device: cache.py slices them there
            buf = _token_bytes(tokens)
            if buf is None or (extra_key is not None and not _hashable(extra_key)):
                return None
            values = None
            if kv is not None:
                n = len(buf) // TOKEN_BYTES
                values = _kv_array(kv, n - n % self.page_size)
                if values is None:
                    return None
            if split_at is not None and split_at > (len(buf) // TOKEN_BYTES
                                                    - len(buf) // TOKEN_BYTES % self.page_size):
                return None
            tree = self.tree
            prefix_len, last, new_leaf, adopted = tree._insert(buf, extra_key, priority,
                                                            hits_from)
            self.inserts += 1
            if held:
                self.new_leaf = new_leaf  # for cache.py's take_new_leaf()
                self.adopted = adopted  # for cache.py's take_adopted()
            if adopted is not None:
                for node, start in adopted:  # top-down: the tier invariant holds throughout
                    size = node.num_tokens
                    node._value = (None if values is None
                                   else values[start:start + size].tobytes())
                    node._on_device = True
                    self.evictable += size
            dropped = None
            if new_leaf is not None:
                added = new_leaf.num_tokens
                if values is not None:
                    # The leaf ends the aligned sequence (prefix_len skips adopted tokens).
                    end = len(buf) // TOKEN_BYTES
                    end -= end % self.page_size
                    tree._store_value(new_leaf, values[end - added:end])
                self.evictable += added
                self.inserted_tokens += added
                dropped = self.heap._push(new_leaf)
            elif self._push_on_access or adopted is not None:
                dropped = self._push_if_evictable(last)  # noqa: F841 -- held until the call returns
            if self.write_through_hits:
                self._queue_due(last)
            if split_at is not None:  # the prefix again: no values, no hits, a new tick
                self.inserts += 1
                _, prefix_last, _, _ = tree._insert(buf[:split_at * TOKEN_BYTES], extra_key,
                                                    split_priority, split_at)
                if self._push_on_access and split_at:
                    dropped_too = self._push_if_evictable(prefix_last)  # noqa: F841
            return InsertResult(prefix_len, last)
        finally:
            if not held:
                self._leave()

    def exists(self, tokens: Any, extra_key: Any = None, held: bool = False) -> bool | None:
        self._take(held, "exists")
        try:
            buf = _token_bytes(tokens)
            if buf is None or (extra_key is not None and not _hashable(extra_key)):
                return None
            return self.tree._exists(buf, extra_key)
        finally:
            if not held:
                self._leave()

    def token_array(self, tokens: Any) -> np.ndarray | None:
        """The common token inputs as a new int64 array; None for anything else."""
        buf = _token_bytes(tokens)
        return None if buf is None else np.frombuffer(buf, dtype=np.int64)

    def _queue_due(self, last: Node) -> None:
        """Append the nodes of the path root..``last`` now due for a write-through copy
        (on the device, no host copy, not queued, hit often enough), top-down."""
        need = self.write_through_hits
        root = self.tree.root
        due = []
        node = last
        while node is not root:
            if (node._on_device and node._host is None and not node._queued
                    and node._hit_count >= need):
                due.append(node)
            node = node._parent
        queue = self.tree._queue
        for node in reversed(due):
            node._queued = True
            queue.append(node)

    def take_adopted(self) -> list:
        """The ``(node, start)`` of the host-only nodes the last ``held`` insert adopted
        (``start``: the offset of the node's first token in the inserted sequence), top-down;
        forgotten here."""
        adopted, self.adopted = self.adopted, None
        return [] if adopted is None else adopted

    def revert_insert(self, adopted: list, leaf: Node | None, held: bool = False) -> None:
        """Undo the tiers of a ``held`` insert whose device values could not be set: its new
        ``leaf`` (``take_new_leaf()``) leaves the tree and the ``adopted`` nodes
        (``take_adopted()``) are host only again; see the module docstring."""
        self._take(held, "insert")
        garbage: list = []  # dropped values and heap entries: released after the guard
        try:
            if leaf is not None and not isinstance(leaf, Node):
                raise TypeError("revert_insert needs the insert's new leaf or None")
            if not all(isinstance(item[0], Node) for item in adopted):
                raise TypeError("revert_insert needs take_adopted()'s (node, start) pairs")
            tree = self.tree
            top = None
            # A node of another cache is in no state this call can undo: left alone.
            if (leaf is not None and not leaf._evicted and leaf._parent is not None
                    and not leaf._children and leaf._on_device and leaf._host is None
                    and not leaf._lock_ref and tree._holds(leaf)):
                size = leaf.num_tokens
                if self._node_tags and leaf in self._node_tags:  # as an evicted leaf's
                    garbage.append(self._move_tags(leaf, leaf._parent))
                self.heap._drop_rank(leaf)
                top, dropped = tree._detach_leaf(leaf)
                garbage.append(dropped)
                self.evictable -= size
                self.inserted_tokens -= size
            for node, _ in reversed(adopted):  # bottom-up: the tier invariant holds
                if (node._evicted or not node._on_device or node._host is None
                        or node._lock_ref or any(c._on_device for c in node._children.values())
                        or not tree._holds(node)):
                    continue
                garbage.append(node._value)
                node._value = None
                node._on_device = False
                self.evictable -= node.num_tokens
                if not node._children:
                    garbage.append(self.host_heap._push(node))
                top = node._parent
            if top is not None:
                if top._on_device:
                    garbage.append(self._push_if_evictable(top))
                elif not top._children:
                    garbage.append(self.host_heap._push(top))
        finally:
            if not held:
                self._leave()
        garbage.clear()

    def take_new_leaf(self) -> Node | None:
        """The leaf the last ``held`` insert made (None if none), forgotten here."""
        leaf, self.new_leaf = self.new_leaf, None
        return leaf

    def walk(self, tokens: Any, extra_key: Any = None) -> int:
        self._take(False, "walk")
        try:
            buf = _token_bytes(tokens)
            if buf is None:
                raise TypeError("walk takes the common token inputs only")
            return self.tree._walk(buf, extra_key)
        finally:
            self._leave()

    # -- locks and eviction ----------------------------------------------------------------
    def lock(self, node: Any, delta: int, held: bool = False) -> int:
        self._take(held, "inc_lock_ref" if delta > 0 else "dec_lock_ref")
        try:
            moved = self.tree._lock(node, delta)
            if delta > 0:
                self.evictable -= moved
                self.protected += moved
            elif moved:
                self.evictable += moved
                self.protected -= moved
                # Only the bottom node can have become an evictable leaf.
                dropped = self._push_if_evictable(node)  # noqa: F841 -- held until the call returns
            return moved
        finally:
            if not held:
                self._leave()

    def set_rank(self, node: Any, rank: Any, held: bool = False) -> None:
        self._take(held, "set_rank")
        try:
            if self.host_tier:
                raise rank_needs_one_tier()
            tree = self.tree
            if node is tree.root:
                raise ValueError("the root has no eviction rank (it is never evicted)")
            tree._check_member(node)
            if type(rank) is not int or not 0 <= rank <= INT64_MAX:
                raise bad_rank("rank", rank)
            dropped = self.heap._set_rank(node, rank)  # noqa: F841 -- released on return
        finally:
            if not held:
                self._leave()

    def tag_session(self, node: Any, session: Any, held: bool = False) -> bool:
        self._take(held, "tag_session")
        try:
            if self.host_tier:
                raise rank_needs_one_tier()
            if type(session) is not int or not 0 <= session <= INT64_MAX:
                raise bad_session(session)
            root = self.tree.root
            if node is root:
                return False  # the root is never tagged (nor evicted)
            self.tree._check_member(node)
            tags = self._node_tags.get(node)
            if tags is not None and session in tags:
                return False
            tagged = self._session_nodes.get(session, ())
            ancestor = node._parent if tagged else root  # the nearest it tags gives its tag up
            while ancestor is not root and ancestor not in tagged:
                ancestor = ancestor._parent
            # Every check is done: only the tables and ranks change from here.
            tags = self._node_tags.setdefault(node, set())
            tags.add(session)
            self._session_nodes.setdefault(session, set()).add(node)
            dropped = [self.heap._set_rank(node, len(tags))]  # released on return
            if ancestor is not root:
                dropped.append(self._drop_tag(ancestor, session))
            return True
        finally:
            if not held:
                self._leave()

    def untag_session(self, session: Any, held: bool = False) -> int:
        self._take(held, "untag_session")
        try:
            if type(session) is not int or not 0 <= session <= INT64_MAX:
                raise bad_session(session)
            nodes = tuple(self._session_nodes.get(session, ()))
            dropped = [self._drop_tag(node, session) for node in nodes]  # noqa: F841
            return len(nodes)
        finally:
            if not held:
                self._leave()

    def session_tags(self, node: Any) -> tuple:
        self.tree._check_member(node)
        return tuple(sorted(self._node_tags.get(node, ())))

    def tagged_nodes(self, session: Any) -> tuple:
        if type(session) is not int:
            raise bad_session(session)
        return tuple(self._session_nodes.get(session, ()))

    def _drop_tag(self, node: Node, session: int) -> Any:
        """``session`` (tagging ``node``) no longer does; returns what the heap let go."""
        tags, tagged = self._node_tags[node], self._session_nodes[session]
        tags.discard(session)
        tagged.discard(node)
        if not tagged:
            del self._session_nodes[session]
        if not tags:
            del self._node_tags[node]
        return self.heap._set_rank(node, len(tags))

    def _move_tags(self, node: Node, parent: Node) -> set:
        """A tagged leaf leaves the tree: its tags go to ``parent`` (see the spec), whose
        rank is set without a push (the removal pushes it). Returns the leaf's old tags."""
        inherit = parent is not self.tree.root
        tags = self._node_tags.pop(node)
        parent_tags = self._node_tags.get(parent) if inherit else None
        for session in tags:
            tagged = self._session_nodes[session]
            tagged.discard(node)
            if inherit and (parent_tags is None or session not in parent_tags):
                if parent_tags is None:
                    parent_tags = self._node_tags[parent] = set()
                parent_tags.add(session)
                tagged.add(parent)
            elif not tagged:
                del self._session_nodes[session]
        if parent_tags is not None:
            self.heap._set_rank(parent, len(parent_tags), push=False)
        return tags

    def pop_victim(self, held: bool = False) -> Node | None:
        stale: list = []  # released when the call returns
        self._take(held, "evict")
        try:
            return self.heap._pop(stale)
        finally:
            if not held:
                self._leave()

    def remove_leaf(self, node: Node, held: bool = False) -> int:
        self._take(held, "evict")
        try:
            size = node.num_tokens
            if not node._evicted:
                self.tree._check_member(node)  # another cache's node
            parent, value = self.tree._detach_leaf(node)  # value released later
            if self._node_tags and node in self._node_tags:
                self._move_tags(node, parent)
            self.heap._drop_rank(node)
            self.evictable -= size
            self.evictions += 1
            self.evicted_tokens += size
            dropped = self._push_if_evictable(parent)  # noqa: F841 -- held until the call returns
            return size
        finally:
            if not held:
                self._leave()

    def _hand_over_one(self, free_callback: Any, handed: list, garbage: list,
                       what: str) -> None:
        """An evict loop's per-node hand-over: the victim's indices (``handed[0]``, taken
        out) go to ``free_callback`` with the guard released. The cache is consistent
        here, so the callback may call it (even evict); what the loop let go (``garbage``)
        and the indices are released outside the guard, then the guard is taken again
        (``what`` names the call to one that holds it meanwhile). On an exception the guard
        is not held."""
        value = handed[0]
        handed[0] = None
        self._leave()
        garbage.clear()
        free_callback(value)
        del value
        self._take(False, what)

    def evict(self, num_tokens: int, free_callback: Any = None, batch: bool = False,
              on_remove: Any = None, backup: Any = None, on_backup: Any = None,
              free_host: Any = None, on_remove_host: Any = None, keep: Any = None,
              page_ids: bool = False) -> int:
        """The whole evict loop; see the module docstring. Takes the guard itself (never
        ``held``): it lets go of it around each per-node callback."""
        pages_of = page_part = 0
        if page_ids:
            if not batch or self.host_tier:
                raise ValueError("evict(page_ids=True) needs batch=True and a cache "
                                 "without a host tier")
            pages_of = self.page_size
        if self.host_tier:
            return self._evict_tiered(num_tokens, free_callback, batch, on_remove, backup,
                                      on_backup, free_host, on_remove_host, keep)
        self._take(False, "evict")
        holding = True
        garbage: list = []  # stale entries, dropped values: released outside the guard
        parts: list | None = [] if batch and free_callback is not None else None
        per_node = free_callback is not None and not batch
        handed: list = [None]  # a per-node callback's argument (see _hand_over_one)
        freed = 0
        error = None
        try:
            tree = self.tree
            heap = self.heap
            while freed < num_tokens:
                node = heap._pop(garbage)
                if node is None:
                    break
                try:
                    parent_rank = None
                    if on_remove is not None:
                        parent_rank = on_remove(node)
                        if parent_rank is not None and (type(parent_rank) is not int
                                                        or not 0 <= parent_rank <= INT64_MAX):
                            raise bad_rank("on_remove's answer (the parent's rank)",
                                           parent_rank)
                        if not heap._may_go(node) or node._parent is None:
                            raise RuntimeError(f"evict: node {node._id} changed during a "
                                               "callback")
                    if per_node:
                        handed[0] = node.value
                    elif pages_of and parts is not None:
                        # Before the detach: torch code (a device value's) may raise.
                        page_part = page_ids_of(node._key if node._value is None
                                                else node._value, pages_of)
                    if parent_rank is not None and node._parent is not tree.root:
                        # Last: nothing after it raises. The parent is no leaf yet: the push
                        # below (once it may be one) uses its new rank.
                        heap._set_rank(node._parent, parent_rank, push=False)
                    if self._node_tags and node in self._node_tags:
                        # Its sessions' tags move up before the parent can be pushed.
                        garbage.append(self._move_tags(node, node._parent))
                except BaseException:
                    garbage.append(heap._push(node))  # still an evictable leaf
                    raise
                size = node.num_tokens
                parent, dropped = tree._detach_leaf(node)
                heap._drop_rank(node)
                garbage.append(dropped)
                if parts is not None:  # handed over only once it left the tree
                    parts.append(page_part if pages_of
                                 else node._key if dropped is None else dropped)
                self.evictable -= size
                self.evictions += 1
                self.evicted_tokens += size
                garbage.append(self._push_if_evictable(parent))
                freed += size
                if per_node:
                    holding = False
                    self._hand_over_one(free_callback, handed, garbage,
                                        "evict, after its free_callback")
                    holding = True
        except BaseException as exc:
            if parts is None:
                raise
            error = exc  # batch: what was evicted is still handed over, then it re-raises
        finally:
            if holding:
                self._leave()
        garbage.clear()
        hand_over_batch(free_callback, parts or None, error, self._join)
        return freed

    def set_value(self, node: Node, values: Any, held: bool = False) -> None:
        self._take(held, "insert")
        try:
            if self._numpy_arrays and not isinstance(values, np.ndarray):
                raise cpu_values_only("set_value", values)
            previous = self.tree._store_value(node, values)  # noqa: F841 -- held until the call returns
        finally:
            if not held:
                self._leave()

    # -- copies and persistence (the state format: see the module docstring) -------------------
    def export_state(self) -> dict:
        """The tree, its clock and the counters as plain data; locks are not carried."""
        if self.host_tier:
            raise TypeError("export_state: a cache with a host tier cannot be exported or "
                            "copied (its host indices belong to the engine's host pool)")
        self._take(False, "export_state")
        try:
            tree = self.tree
            records: list = []
            stack = [(tree.root, -1)]
            while stack:
                node, at = stack.pop()
                for child in node._children.values():
                    value = child._value
                    if value is not None and type(value) is not bytes:
                        value = value.clone()  # a device tensor: this node's part, copied
                    stack.append((child, len(records)))
                    records.append((at, child._key, value, child._extra_key, child._priority,
                                    child._last_access_time, child._created_time,
                                    child._hit_count, child._terminal, child._id))
            return {"nodes": records, "clock": tree.clock, "num_splits": tree.num_splits,
                    "empty_inserted": list(tree._empty_inserted),
                    "counters": (self.lookups, self.matched_tokens, self.queried_tokens,
                                 self.inserts, self.inserted_tokens, self.evictions,
                                 self.evicted_tokens)}
        finally:
            self._leave()

    def import_state(self, state: dict) -> None:
        """Rebuild an exported state into this core, which must be empty; every node unlocked
        (so evictable) and every leaf on the heap. ValueError for a malformed state."""
        self._take(False, "import_state")
        try:
            tree = self.tree
            if tree.node_count or tree.clock or tree._empty_inserted:
                raise ValueError("import_state needs an empty core")
            # A copy (user code runs below), CPU values only for a core of numpy arrays.
            state = check_state(state, self.page_size, self._numpy_arrays)
            records = state["nodes"]
            page_bytes = tree._page_bytes
            nodes = []
            evictable = 0
            try:
                for (at, key, value, extra_key, priority, last, created, hits, terminal,
                     _) in records:
                    parent = tree.root if at < 0 else nodes[at]
                    if at >= 0:
                        extra_key = parent._extra_key
                    node = tree._Node(key, parent, extra_key, last, priority)
                    node._created_time = created
                    node._hit_count = hits
                    node._terminal = terminal
                    node._value = value
                    # The state's check ran the extra_keys' __eq__; they may answer otherwise
                    # now: the tree itself must hold one child per (namespace, first page).
                    child_key = tree._child_key(parent, extra_key, key[:page_bytes])
                    if parent._children.setdefault(child_key, node) is not node:
                        raise ValueError(f"bad tree state: node {len(nodes)} starts with the "
                                         "same page as a sibling")
                    tree._filed(node, child_key)
                    nodes.append(node)
                    evictable += len(key) // TOKEN_BYTES
                fresh = sorted(node._id for node in nodes)
                for rank, i in enumerate(id_order(records)):
                    nodes[i]._id = fresh[rank]
                tree.node_count = len(nodes)
                tree.clock = state["clock"]
                tree.num_splits = state["num_splits"]
                tree._empty_inserted = set(state["empty_inserted"])
                (self.lookups, self.matched_tokens, self.queried_tokens, self.inserts,
                 self.inserted_tokens, self.evictions, self.evicted_tokens) = state["counters"]
                self.evictable = evictable
                for node in nodes:
                    if not node._children:
                        self.heap._push(node)
            except BaseException:
                self.reset(True)
                raise
        finally:
            self._leave()


# -- a slot pool's free stack (see the module docstring) -----------------------------------
_max_of = np.maximum.reduce  # an array's largest element, without ndarray.max's wrappers
_INT64_DTYPES = (np.dtype(np.int64), np.dtype(np.longlong))


def _is_int64_dtype(dtype: Any) -> bool:
    """One of numpy's builtin native int64 dtypes (as the compiled core checks: by identity)."""
    return dtype is _INT64_DTYPES[0] or dtype is _INT64_DTYPES[1]


def put_slots(stack: Any, top: int, slots: Any, bound: int) -> int:
    """Push ``slots`` on a pool's free stack at ``top``; see the module docstring."""
    if not (INT64_MIN <= top <= INT64_MAX and INT64_MIN <= bound <= INT64_MAX):
        raise OverflowError("top and bound must fit in int64")
    if (type(stack) is not np.ndarray or not _is_int64_dtype(stack.dtype) or stack.ndim != 1
            or not stack.flags.c_contiguous or not stack.flags.writeable or top < 0 or bound < 0):
        return -1
    kind = type(slots)
    if kind is np.ndarray:
        ids = slots
    elif kind is array.array:
        if slots.typecode not in "ql" or slots.itemsize != 8:
            return -1
        ids = np.frombuffer(slots, dtype=np.int64)
    elif (kind is _Tensor and not _torch._C._is_torch_function_mode_enabled()
            and slots.is_cpu and slots.dtype is _int64 and slots.layout is _torch.strided
            and not _Tensor.is_neg(slots)):
        try:
            ids = _Tensor.numpy(slots)
        except (RuntimeError, TypeError):  # a tensor numpy cannot view (a zero tensor)
            return -1
    else:
        return -1
    if not _is_int64_dtype(ids.dtype) or ids.ndim != 1 or not ids.flags.c_contiguous:
        return -1
    n = len(ids)
    if n > min(bound, len(stack)) - top:
        return -1
    if n and int(_max_of(ids.view(np.uint64))) >= bound:  # a negative id reads as a huge one
        return -1
    stack[top:top + n] = ids
    return n
