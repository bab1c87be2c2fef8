"""The Lua scripts of the Redis or Valkey index (``radixcache.router.redis_store``, whose
docstring gives the key layout they share): each runs whole on the server (EVALSHA), so a
batch, a lookup, a take-over or a collection is one atomic round trip. ``P`` is the index's
key prefix, ``rc:{namespace}:``.
"""

# Shared Lua: the holders string of a block, and a copy's journal.
_COMMON = r"""
local P = ARGV[1]
local call, sub = redis.call, string.sub
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local blocks_delta = 0
local held_delta = {}
local function u32(s, i)
  local a, b, c, d = string.byte(s, i, i + 3)
  return ((a * 256 + b) * 256 + c) * 256 + d
end
local function u16(s, i)
  local a, b = string.byte(s, i, i + 1)
  return a * 256 + b
end
local function u32s(n)
  return string.char(math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
                     math.floor(n / 256) % 256, n % 256)
end
-- Blocks are read with one HMGET and written back with one HSET and one HDEL per run of
-- keys (in chunks): every Lua instruction counts (a script runs under a count hook), so the
-- per-block work is kept to a few table reads and writes.
local BK = P .. 'blocks'
local CHUNK = 2000  -- keys per call (Lua's unpack and struct.unpack stop near 8,000 values)
local rep, unpack_s = string.rep, struct.unpack
-- the n 8-byte keys of s from s[at]
local function keys_at(s, at, n)
  if n <= CHUNK then
    local keys = {unpack_s(rep('c8', n), s, at)}
    keys[n + 1] = nil  -- struct.unpack's next position
    return keys
  end
  local keys = {}
  for c = 0, n - 1, CHUNK do
    local k = math.min(CHUNK, n - c)
    local part = {unpack_s(rep('c8', k), s, at + 8 * c)}
    for x = 1, k do keys[c + x] = part[x] end
  end
  return keys
end
-- holders string v (or false) with d holdings more for (wid, m): the new string (false:
-- none left) and the holdings changed
local function bumped(v, wid, m, d)
  if not v then
    if d > 0 then return ',' .. wid .. ':' .. m .. ':' .. d, d end
    return false, 0
  end
  local out = {}
  local found = false
  for w, mm, c in string.gmatch(v, '(%d+):(%d+):(%d+)') do
    if w == wid and mm == m then
      found = true
      local n = tonumber(c) + d
      if n > 0 then out[#out + 1] = w .. ':' .. mm .. ':' .. n end
    else
      out[#out + 1] = w .. ':' .. mm .. ':' .. c
    end
  end
  if not found then
    if d <= 0 then return v, 0 end
    out[#out + 1] = wid .. ':' .. m .. ':' .. d
  end
  if #out == 0 then return false, d end
  return ',' .. table.concat(out, ','), d
end
local function held_by(wid, m, held)
  if held ~= 0 then
    local f = 'h:' .. wid .. ':' .. m
    held_delta[f] = (held_delta[f] or 0) + held
  end
end
-- add d holdings (per[key] when per is given) of the n blocks keys for (wid, m). A key met
-- twice in a chunk ends the chunk there: the next one reads what this one wrote.
local function bump_keys(keys, n, wid, m, d, per)
  local single = ',' .. wid .. ':' .. m .. ':1'
  local held = 0
  local a = 1
  while a <= n do
    local b = math.min(a + CHUNK - 1, n)
    local got = call('HMGET', BK, unpack(keys, a, b))
    local sets, ns, dels, nd, seen = {}, 0, {}, 0, {}
    local after = b + 1
    for x = a, b do
      local k = keys[x]
      if seen[k] then after = x; break end
      seen[k] = true
      local v = got[x - a + 1]
      local dd = d
      if per then dd = per[k] end
      if not v and dd == 1 then  -- a block no worker holds yet: the common case of a store
        ns = ns + 2; sets[ns - 1] = k; sets[ns] = single
        blocks_delta = blocks_delta + 1
        held = held + 1
      else
        local nv, done = bumped(v, wid, m, dd)
        if done ~= 0 then
          held = held + done
          if nv then
            ns = ns + 2; sets[ns - 1] = k; sets[ns] = nv
            if not v then blocks_delta = blocks_delta + 1 end
          else
            nd = nd + 1; dels[nd] = k
            blocks_delta = blocks_delta - 1
          end
        end
      end
    end
    if ns > 0 then call('HSET', BK, unpack(sets, 1, ns)) end
    if nd > 0 then call('HDEL', BK, unpack(dels, 1, nd)) end
    a = after
  end
  held_by(wid, m, held)
end
-- a run of n blocks (8 bytes each from s[at]) held once more (d = 1) or once less (-1)
local function bump_run(s, at, n, wid, m, d)
  bump_keys(keys_at(s, at, n), n, wid, m, d)
end
-- the net holdings and publisher hashes of a journal
local function parse(j)
  local counts, order, pub = {}, {}, {}
  local i, n = 1, #j
  while i <= n do
    local t = string.sub(j, i, i)
    if t == '+' or t == '-' then
      local c = u32(j, i + 1)
      local d = t == '+' and 1 or -1
      for p = i + 5, i + 5 + 8 * (c - 1), 8 do
        local k = string.sub(j, p, p + 7)
        if counts[k] == nil then counts[k] = 0; order[#order + 1] = k end
        counts[k] = counts[k] + d
      end
      i = i + 5 + 8 * c
    elseif t == 'H' then
      local c, len, kind = u32(j, i + 1), u16(j, i + 5), string.sub(j, i + 7, i + 7)
      local hs = i + 8 + 8 * c
      for x = 0, c - 1 do
        local p = i + 8 + 8 * x
        local h = hs + len * x
        pub[kind .. string.sub(j, h, h + len - 1)] = string.sub(j, p, p + 7)
      end
      i = hs + len * c
    elseif t == 'G' then
      local c, len, kind = u32(j, i + 1), u16(j, i + 5), string.sub(j, i + 7, i + 7)
      for h = i + 8, i + 8 + len * (c - 1), len do
        pub[kind .. string.sub(j, h, h + len - 1)] = nil
      end
      i = i + 8 + len * c
    elseif t == 'P' then
      local len = u16(j, i + 9)
      pub[string.sub(j, i + 11, i + 10 + len)] = string.sub(j, i + 1, i + 8)
      i = i + 11 + len
    else -- 'Q'
      local len = u16(j, i + 1)
      pub[string.sub(j, i + 3, i + 2 + len)] = nil
      i = i + 3 + len
    end
  end
  return counts, order, pub
end
-- drop every holding of copy cid (worker wid, tier m)
local function clear_copy(cid, wid, m)
  local jk = P .. 'j:' .. cid
  local j = redis.call('GET', jk)
  if j then
    local counts, order = parse(j)
    local keys, per = {}, {}
    for _, k in ipairs(order) do
      if counts[k] > 0 then keys[#keys + 1] = k; per[k] = -counts[k] end
    end
    bump_keys(keys, #keys, wid, m, 0, per)
    redis.call('DEL', jk)
  end
  redis.call('HDEL', P .. 'n', 'c:' .. cid, 'z:' .. cid, 'd:' .. cid)
end
local function flush_counters()
  if blocks_delta ~= 0 then redis.call('HINCRBY', P .. 'n', 'blocks', blocks_delta) end
  local media = {}
  for f, d in pairs(held_delta) do
    local m = string.match(f, ':(%d+)$')
    media['m:' .. m] = (media['m:' .. m] or 0) + d
  end
  for f, d in pairs(media) do held_delta[f] = d end
  for f, d in pairs(held_delta) do
    if d ~= 0 then
      local left = redis.call('HINCRBY', P .. 'n', f, d)
      if left <= 0 then redis.call('HDEL', P .. 'n', f) end
    end
  end
end
local function collect_worker(wid)
  for _, member in ipairs(redis.call('SMEMBERS', P .. 'wc:' .. wid)) do
    local cid, m = string.match(member, '(%d+):(%d+)')
    clear_copy(cid, wid, m)
  end
  redis.call('HDEL', P .. 'seq', wid)
  redis.call('ZREM', P .. 'leases', wid)
  redis.call('DEL', P .. 'lease:' .. wid)
end
"""

# ARGV: P, wid, token, lease_ms, epoch, seq, then (cid, m, ops) triples. Ops (counts and
# lengths big endian): '+' n4 keys (n blocks held once more), '-' n4 keys (once less),
# 'H' n4 len2 tag keys hashes (n publisher hashes of one length, mapped to keys), 'G' n4
# len2 tag hashes (unmapped), 'P' key len2 hash, 'Q' len2 hash, 'C' (clear the copy). A
# hash is its journal bytes: 'b' + the bytes, 'q' + an int64 (8 bytes, little endian) or
# 'i' + a larger int in decimal; a run's hashes are its tag + each one's len bytes.
APPLY = "#!lua\n" + _COMMON + r"""
local wid, token = ARGV[2], ARGV[3]
local lease_ms, epoch, seq = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local lk = P .. 'lease:' .. wid
local cur = redis.call('GET', lk)
if cur and cur ~= token then return 'foreign' end
if not cur and not redis.call('ZSCORE', P .. 'leases', wid) then return 'lost' end
local stored = redis.call('HGET', P .. 'seq', wid)
if stored and seq >= 0 then
  local se, ss = string.match(stored, '(-?%d+):(-?%d+)')
  if tonumber(se) == epoch and seq <= tonumber(ss) then return 'stale' end
end
-- the lease: renewed once a third of it has passed (most batches leave it as it is)
if not cur or redis.call('PTTL', lk) < lease_ms - lease_ms / 3 then
  redis.call('SET', lk, token, 'PX', lease_ms)
  redis.call('ZADD', P .. 'leases', now_ms() + lease_ms, wid)
end
for a = 7, #ARGV, 3 do
  local cid, m, ops = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local jk = P .. 'j:' .. cid
  local live = 0
  local dead = 0  -- journal records this batch made dead (removals, unmapped hashes)
  local seg = 1  -- the journal records since the last 'C' start here
  local i, n = 1, #ops
  while i <= n do
    local t = string.sub(ops, i, i)
    if t == '+' or t == '-' then
      local c = u32(ops, i + 1)
      local d = t == '+' and 1 or -1
      if c > 0 then bump_run(ops, i + 5, c, wid, m, d) end
      live = live + d * c
      if d < 0 then dead = dead + c end
      i = i + 5 + 8 * c
    elseif t == 'H' then
      i = i + 8 + u32(ops, i + 1) * (8 + u16(ops, i + 5))
    elseif t == 'G' then
      local c = u32(ops, i + 1)
      dead = dead + c
      i = i + 8 + c * u16(ops, i + 5)
    elseif t == 'P' then
      i = i + 11 + u16(ops, i + 9)
    elseif t == 'Q' then
      dead = dead + 1
      i = i + 3 + u16(ops, i + 1)
    else -- 'C'
      if i > seg then redis.call('APPEND', jk, string.sub(ops, seg, i - 1)) end
      if live ~= 0 then redis.call('HINCRBY', P .. 'n', 'c:' .. cid, live); live = 0 end
      clear_copy(cid, wid, m)
      dead = 0
      i = i + 1
      seg = i
    end
  end
  if n >= seg then
    local size = redis.call('APPEND', jk, string.sub(ops, seg, n))
    local held = redis.call('HINCRBY', P .. 'n', 'c:' .. cid, live)
    if dead > 0 then redis.call('HINCRBY', P .. 'n', 'd:' .. cid, dead) end
    local z = redis.call('HMGET', P .. 'n', 'z:' .. cid, 'd:' .. cid)
    local last, gone = tonumber(z[1] or '0'), tonumber(z[2] or '0')
    -- Compacted past twice its last compacted size when a third of its records or more
    -- are dead, past four times in any case (a journal of live blocks gains nothing).
    if size > 4096 + 4 * last or (size > 4096 + 2 * last and 2 * gone >= held) then
      -- compact: the net holdings and the live publisher hashes only
      local counts, order, pub = parse(redis.call('GET', jk))
      local parts = {''}
      for _, k in ipairs(order) do
        for _ = 1, counts[k] do parts[#parts + 1] = k end
      end
      parts[1] = '+' .. u32s(#parts - 1)
      -- the live publisher hashes, one 'H' run per kind and length
      local runs, kinds = {}, {}
      for h, k in pairs(pub) do
        local g = sub(h, 1, 1) .. (#h - 1)
        local run = runs[g]
        if not run then
          run = {sub(h, 1, 1), #h - 1, {}, {}}
          runs[g] = run
          kinds[#kinds + 1] = g
        end
        run[3][#run[3] + 1] = k
        run[4][#run[4] + 1] = sub(h, 2)
      end
      for _, g in ipairs(kinds) do
        local run = runs[g]
        parts[#parts + 1] = 'H' .. u32s(#run[3]) .. string.char(math.floor(run[2] / 256),
          run[2] % 256) .. run[1] .. table.concat(run[3]) .. table.concat(run[4])
      end
      local compacted = table.concat(parts)
      redis.call('SET', jk, compacted)
      redis.call('HSET', P .. 'n', 'z:' .. cid, #compacted)
      redis.call('HDEL', P .. 'n', 'd:' .. cid)
    end
  elseif live ~= 0 then
    redis.call('HINCRBY', P .. 'n', 'c:' .. cid, live)
  end
end
if seq >= 0 then redis.call('HSET', P .. 'seq', wid, epoch .. ':' .. seq) end
flush_counters()
return 'ok'
"""

# ARGV: P, media (",m1,m2,", or "*": every tier), keys (8 bytes each). Returns wid, depth,
# wid, depth, ...
# The blocks are read with one HMGET per chunk of the chain (32 blocks, then twice as many
# up to 256), so a walk reads at most one chunk past where it stops. A block whose holders
# are the string of the block before (the common case) costs a table read and a compare;
# when they change, each worker still in its run is looked for as ",wid:m:" (one plain find
# per tier of the query), no string made.
OVERLAP = "#!lua flags=no-writes\n" + r"""
local P, media, keys = ARGV[1], ARGV[2], ARGV[3]
local call, find, gmatch = redis.call, string.find, string.gmatch
local rep, unpack_s = string.rep, struct.unpack
local bk = P .. 'blocks'
local needles, order = nil, {}  -- per worker in its run: ",wid:m:" per tier of the query
local out = {}
local last = nil
local n = math.floor(#keys / 8)
local pos, chunk = 0, 32
local depth = nil  -- where the walk stopped
while depth == nil and pos < n do
  local m = math.min(chunk, n - pos)
  -- the chunk's fields, and struct.unpack's next position: a field no block has
  local got = call('HMGET', bk, unpack_s(rep('c8', m), keys, 8 * pos + 1))
  for x = 1, m do
    local v = got[x]
    if v ~= last then  -- the same holders as the block before: the same runs go on
      last = v
      if not v then depth = pos + x - 1; break end
      if needles == nil then
        needles = {}
        for w, mm in gmatch(v, '(%d+):(%d+):%d+') do
          if needles[w] == nil and (media == '*' or find(media, ',' .. mm .. ',', 1, true)) then
            local ws = {}
            if media == '*' then
              ws[1] = ',' .. w .. ':'  -- any tier of the worker
            else
              for code in gmatch(media, '%d+') do ws[#ws + 1] = ',' .. w .. ':' .. code .. ':' end
            end
            needles[w] = ws
            order[#order + 1] = w
          end
        end
        if #order == 0 then depth = 0; break end
      else
        local alive = false
        for _, w in ipairs(order) do
          local ws = needles[w]
          if ws then
            local held = false
            for _, needle in ipairs(ws) do
              if find(v, needle, 1, true) then held = true; break end
            end
            if held then alive = true
            else needles[w] = false; out[#out + 1] = w; out[#out + 1] = pos + x - 1 end
          end
        end
        if not alive then depth = pos + x - 1; break end
      end
    end
  end
  pos = pos + m
  if chunk < 256 then chunk = chunk * 2 end
end
depth = depth or n
for _, w in ipairs(order) do
  if needles[w] then out[#out + 1] = w; out[#out + 1] = depth end
end
return out
"""

# ARGV: P, kind ('w', 'm' or 'c'), name. Returns the id of the name, made when missing.
REGISTER = "#!lua\n" + r"""
local P, kind, name = ARGV[1], ARGV[2], ARGV[3]
local tables = {w = 'workers', m = 'media', c = 'copies'}
local h = P .. tables[kind]
local id = redis.call('HGET', h, 'n:' .. name)
if not id then
  id = tostring(redis.call('HINCRBY', P .. 'n', 'next:' .. kind, 1) - 1)
  redis.call('HSET', h, 'n:' .. name, id, 'i:' .. id, name)
end
if kind == 'c' then
  local wid, m = string.match(name, '^(%d+)|(%d+)|')
  redis.call('SADD', P .. 'wc:' .. wid, id .. ':' .. m)
end
return id
"""

# ARGV: P, wid, token, lease_ms. Takes the worker's ingest over unless another router's
# lease is live. Returns {status, epoch:seq or false, journals as cid, m, journal...}.
ACQUIRE = "#!lua\n" + _COMMON + r"""
local wid, token, lease_ms = ARGV[2], ARGV[3], tonumber(ARGV[4])
local lk = P .. 'lease:' .. wid
local cur = redis.call('GET', lk)
if cur and cur ~= token then return {'foreign'} end
redis.call('SET', lk, token, 'PX', lease_ms)
redis.call('ZADD', P .. 'leases', now_ms() + lease_ms, wid)
local out = {'ok', redis.call('HGET', P .. 'seq', wid) or ''}
for _, member in ipairs(redis.call('SMEMBERS', P .. 'wc:' .. wid)) do
  local cid, m = string.match(member, '(%d+):(%d+)')
  local j = redis.call('GET', P .. 'j:' .. cid)
  if j then
    out[#out + 1] = cid
    out[#out + 1] = j
  end
end
return out
"""

# ARGV: P, token, lease_ms, wid... Renews this router's leases; returns the ones it lost.
RENEW = "#!lua\n" + r"""
local P, token, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lost = {}
for a = 4, #ARGV do
  local wid = ARGV[a]
  local lk = P .. 'lease:' .. wid
  local cur = redis.call('GET', lk)
  if cur == token or (not cur and redis.call('ZSCORE', P .. 'leases', wid)) then
    redis.call('SET', lk, token, 'PX', lease_ms)
    redis.call('ZADD', P .. 'leases', now + lease_ms, wid)
  else
    lost[#lost + 1] = wid
  end
end
return lost
"""

# ARGV: P, limit. Collects the workers whose lease expired; returns their ids.
COLLECT = "#!lua\n" + _COMMON + r"""
local limit = tonumber(ARGV[2])
local now = now_ms()
local done = {}
for _, wid in ipairs(redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', now, 'LIMIT', 0, limit)) do
  local ttl = redis.call('PTTL', P .. 'lease:' .. wid)
  if ttl > 0 then
    redis.call('ZADD', P .. 'leases', now + ttl, wid)
  else
    collect_worker(wid)
    done[#done + 1] = wid
  end
end
flush_counters()
return done
"""

# ARGV: P, token, wid. Drops a worker (remove_worker): every copy, its sequence and lease.
REMOVE = "#!lua\n" + _COMMON + r"""
local token, wid = ARGV[2], ARGV[3]
local cur = redis.call('GET', P .. 'lease:' .. wid)
if cur and cur ~= token then return 'foreign' end
collect_worker(wid)
flush_counters()
return 'ok'
"""
