"""The Lua scripts that make every write to a Redis ledger one atomic step.

The layout (`_layout`): each record is a hash (`status`, `token`, `revision`, `doc`)
under `<prefix>r:<key>`, and each status has a sorted set `<prefix>i:<STATUS>` of keys
scored by their last update. The keys of the package's own documents
(`crewai-idempotent/...`) are also members of `<prefix>docs`, all scored 0, so a prefix
of them is a ZRANGEBYLEX. A script reads and writes in one step, which Redis runs
atomically, so nothing is read in one round trip and written in another. Each script is
idempotent: one whose effect is already stored reports success, so a script sent again
after a lost reply cannot turn a landed write into a refusal.

This release's scripts also keep the secondary indexes (`<prefix>x:...`) in the same
step, from entries the client computes from the record it writes (`_layout.Entries`: no
JSON is parsed here, so no document can make a write fail), note in the hash which
entries the record has (removed exactly when it changes), and increment the change
counter. The previous release's scripts (the text of commit 61b49de, which its workers
send during a rolling deployment) keep only the status indexes and `docs`, so those stay
exactly as they maintain them.
"""

from __future__ import annotations

from typing import Any

from ...ledger._backend import DOCUMENTS


def _reindex(
    e: int | str, at: str, needs: str, expiry: str, buckets: str, member: str = "ARGV[1]"
) -> str:
    """Lua that makes a record's secondary entries those of ARGV[e..e+6] (stamp, needs,
    expiry, state, timed, bucket, subject: text, '' for none; `e` a number or a Lua
    expression) for `member` (Lua: the record's key), with
    `at` its last update: it leaves the sets the record's hash names (`xf`: xn, xe, xs, xt,
    xk as read, false when absent) that the new entries do not keep, and adds the hash
    fields to set to `set` and those to delete to `gone`. Written out inline: a Lua
    function (a closure made on every call) costs a claim more than these lines."""
    a = [f"ARGV[{e + i}]" if isinstance(e, int) else f"ARGV[{e} + {i}]" for i in range(7)]
    return f"""
set[#set + 1] = 'x'; set[#set + 1] = {a[0]}
if {a[1]} ~= '' then
    redis.call('ZADD', {needs}, {at}, {member}); set[#set + 1] = 'xn'; set[#set + 1] = '1'
elseif xf[1] then
    redis.call('ZREM', {needs}, {member}); gone[#gone + 1] = 'xn'
end
if {a[2]} ~= '' then
    redis.call('ZADD', {expiry}, {a[2]}, {member}); set[#set + 1] = 'xe'; set[#set + 1] = '1'
elseif xf[2] then
    redis.call('ZREM', {expiry}, {member}); gone[#gone + 1] = 'xe'
end
if xf[3] and xf[3] ~= {a[3]} then redis.call('ZREM', xf[3], {member}) end
if {a[3]} ~= '' then
    redis.call('ZADD', {a[3]}, 0, {member}); set[#set + 1] = 'xs'; set[#set + 1] = {a[3]}
elseif xf[3] then
    gone[#gone + 1] = 'xs'
end
if xf[4] and xf[4] ~= {a[4]} then redis.call('ZREM', xf[4], {member}) end
if {a[4]} ~= '' then
    redis.call('ZADD', {a[4]}, {at}, {member}); redis.call('SADD', {buckets}, {a[5]})
    set[#set + 1] = 'xt'; set[#set + 1] = {a[4]}
elseif xf[4] then
    gone[#gone + 1] = 'xt'
end
if xf[5] and xf[5] ~= {a[6]} then redis.call('ZREM', xf[5], {member}) end
if {a[6]} ~= '' then
    redis.call('ZADD', {a[6]}, 0, {member}); set[#set + 1] = 'xk'; set[#set + 1] = {a[6]}
elseif xf[5] then
    gone[#gone + 1] = 'xk'
end
"""


# KEYS[1] the record; KEYS[2] the index of the new status; KEYS[3] the documents' index;
# KEYS[4] the change counter; KEYS[5..7] x:n, x:e, x:buckets.
# ARGV: key, status, token, revision, updated_at, doc, resent (1 when sent again after a lost
# reply: finding exactly our record then means the first send landed; owner ids are random,
# so no one else's record is ever identical), then the 7 entries. Returns nil if stored,
# else the holder.
CLAIM = f"""
local held = redis.call('HGET', KEYS[1], 'doc')
if held then
    if ARGV[7] == '1' and held == ARGV[6] then return false end
    return held
end
local xf = {{}}
local set = {{'status', ARGV[2], 'token', ARGV[3], 'revision', ARGV[4], 'doc', ARGV[6]}}
local gone = {{}}
{_reindex(8, "ARGV[5]", "KEYS[5]", "KEYS[6]", "KEYS[7]")}
redis.call('HSET', KEYS[1], unpack(set))
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
if string.sub(ARGV[1], 1, {len(DOCUMENTS)}) == '{DOCUMENTS}' then
    redis.call('ZADD', KEYS[3], 0, ARGV[1])
end
redis.call('INCR', KEYS[4])
return false
"""

# KEYS[1] the record; KEYS[2..5] the PENDING, COMMITTED, FAILED, UNCERTAIN indexes;
# KEYS[6] the change counter; KEYS[7..9] x:n, x:e, x:buckets.
# ARGV: key, current token, current revision, status, token, revision, updated_at, doc,
# then the 7 entries. A record already equal to the new one counts as replaced: an earlier
# send of this same write landed and its reply was lost (no other writer produces an
# identical record: each carries its time and a random owner id).
REPLACE = f"""
local held = redis.call('HMGET', KEYS[1], 'status', 'token', 'revision', 'doc',
                        'xn', 'xe', 'xs', 'xt', 'xk')
if held[2] ~= ARGV[2] or held[3] ~= ARGV[3] then
    if held[2] == ARGV[5] and held[3] == ARGV[6] and held[4] == ARGV[8] then return 1 end
    return 0
end
local index = {{PENDING = KEYS[2], COMMITTED = KEYS[3], FAILED = KEYS[4], UNCERTAIN = KEYS[5]}}
local xf = {{held[5], held[6], held[7], held[8], held[9]}}
local set = {{'status', ARGV[4], 'token', ARGV[5], 'revision', ARGV[6], 'doc', ARGV[8]}}
local gone = {{}}
{_reindex(9, "ARGV[7]", "KEYS[7]", "KEYS[8]", "KEYS[9]")}
redis.call('HSET', KEYS[1], unpack(set))
if #gone > 0 then redis.call('HDEL', KEYS[1], unpack(gone)) end
if held[1] ~= ARGV[4] then redis.call('ZREM', index[held[1]], ARGV[1]) end
redis.call('ZADD', index[ARGV[4]], ARGV[7], ARGV[1])
redis.call('INCR', KEYS[6])
return 1
"""

# KEYS as for REPLACE's first five, then KEYS[6] the documents' index, KEYS[7] the change
# counter, KEYS[8..9] x:n, x:e; ARGV: key, token, revision.
DELETE = """
local held = redis.call('HMGET', KEYS[1], 'status', 'token', 'revision',
                        'xn', 'xe', 'xs', 'xt', 'xk')
if held[2] ~= ARGV[2] or held[3] ~= ARGV[3] then return 0 end
local index = {PENDING = KEYS[2], COMMITTED = KEYS[3], FAILED = KEYS[4], UNCERTAIN = KEYS[5]}
redis.call('DEL', KEYS[1])
redis.call('ZREM', index[held[1]], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
if held[4] then redis.call('ZREM', KEYS[8], ARGV[1]) end
if held[5] then redis.call('ZREM', KEYS[9], ARGV[1]) end
for i = 6, 8 do
    if held[i] then redis.call('ZREM', held[i], ARGV[1]) end
end
redis.call('INCR', KEYS[7])
return 1
"""

# Heal on read: the secondary entries of records read whose hashes say they are not their
# versions' (the previous release wrote them, or they predate this release). KEYS[1..3]
# x:n, x:e, x:buckets. ARGV[1] the records' key prefix, then per record 11: key, token,
# revision, updated_at of the version read, its 7 entries. Each only if that version is
# still stored (else its writer kept the entries, or a later reader will). Returns how
# many were healed. Not a change to the ledger (no count). Sent for at most `HEALS`
# records at a time, so it holds the server about as long as a claim.
HEAL = f"""
local healed = 0
for j = 2, #ARGV, 11 do
    local rkey = ARGV[1] .. ARGV[j]
    local held = redis.call('HMGET', rkey, 'token', 'revision', 'xn', 'xe', 'xs', 'xt', 'xk')
    if held[1] == ARGV[j + 1] and held[2] == ARGV[j + 2] then
        local xf = {{held[3], held[4], held[5], held[6], held[7]}}
        local set = {{}}
        local gone = {{}}
        {_reindex("j + 4", "ARGV[j + 3]", "KEYS[1]", "KEYS[2]", "KEYS[3]", "ARGV[j]")}
        redis.call('HSET', rkey, unpack(set))
        if #gone > 0 then redis.call('HDEL', rkey, unpack(gone)) end
        healed = healed + 1
    end
end
return healed
"""
HEALS = 20
#: Members a walk (WALK_SET, WALK_RANGE) looks at per script: a few hundred HMGETs.
WALK = 250

# The records of many keys in one step: ARGV[1] the records' key prefix, then the keys.
# Returns each key's `doc` and `x` (false for none), flat.
FETCH = """
local out = {}
for i = 2, #ARGV do
    local h = redis.call('HMGET', ARGV[1] .. ARGV[i], 'doc', 'x')
    out[#out + 1] = h[1]
    out[#out + 1] = h[2]
end
return out
"""

# A stale entry: KEYS[1] the record, KEYS[2] the secondary index it was found in. ARGV: the
# key, and the hash field that names the index when the record is in it ('xn', 'xe' hold
# '1'; 'xs', 'xt', 'xk' the index's name). Removed unless the record's hash names it (a
# record the previous release deleted leaves its entries; one written since has its own).
DROP = """
local named = redis.call('HGET', KEYS[1], ARGV[2])
if named == '1' or named == KEYS[2] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# The members of a sorted set whose records' secondary entries are not their version's:
# one ZSCAN step. KEYS[1] the set; ARGV: cursor, count, the records' key prefix. Returns
# the next cursor, then those members (a member whose record is gone is not one).
WALK_SET = """
local step = redis.call('ZSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local out = {step[1]}
local found = step[2]
for i = 1, #found, 2 do
    local h = redis.call('HMGET', ARGV[3] .. found[i], 'token', 'revision', 'x')
    if h[1] and h[2] and h[3] ~= h[1] .. ':' .. h[2] then out[#out + 1] = found[i] end
end
return out
"""

# As WALK_SET over a range of the documents' index (all scored 0): KEYS[1] the set; ARGV:
# low, high (ZRANGEBYLEX bounds), count, the records' key prefix. Returns how many members
# were looked at and the last of them ('' for none), then those whose entries are stale.
WALK_RANGE = """
local found = redis.call('ZRANGEBYLEX', KEYS[1], ARGV[1], ARGV[2], 'LIMIT', 0, ARGV[3])
local out = {#found, found[#found] or ''}
for i = 1, #found do
    local h = redis.call('HMGET', ARGV[4] .. found[i], 'token', 'revision', 'x')
    if h[1] and h[2] and h[3] ~= h[1] .. ':' .. h[2] then out[#out + 1] = found[i] end
end
return out
"""

# Of the keys given (ARGV[2..]), those whose records' entries are stale; ARGV[1] the
# records' key prefix.
STALE = """
local out = {}
for i = 2, #ARGV do
    local h = redis.call('HMGET', ARGV[1] .. ARGV[i], 'token', 'revision', 'x')
    if h[1] and h[2] and h[3] ~= h[1] .. ':' .. h[2] then out[#out + 1] = ARGV[i] end
end
return out
"""

# The next entries of a sorted set after a member, by rank: KEYS[1] the set; ARGV: the
# member's score as the caller last saw it, the member, count, '1' for descending. Returns
# member, score pairs (flat), or false when the member is no longer there at that score
# (the caller then goes by score).
AFTER = """
local held = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not held or tonumber(held) ~= tonumber(ARGV[1]) then return false end
local n = tonumber(ARGV[3])
if ARGV[4] == '1' then
    local rank = redis.call('ZREVRANK', KEYS[1], ARGV[2])
    return redis.call('ZRANGE', KEYS[1], rank + 1, rank + n, 'REV', 'WITHSCORES')
end
local rank = redis.call('ZRANK', KEYS[1], ARGV[2])
return redis.call('ZRANGE', KEYS[1], rank + 1, rank + n, 'WITHSCORES')
"""

# A ledger no one has written yet is complete from the start: KEYS[1] x:ready, KEYS[2]
# x:fill, KEYS[3] docs, KEYS[4..7] the status indexes. Returns 1 when ready.
FRESH = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
for i = 3, 7 do
    if redis.call('ZCARD', KEYS[i]) > 0 then return 0 end
end
redis.call('SET', KEYS[1], 'fresh')
return 1
"""


class Scripts:
    """The scripts registered on one client (EVALSHA, loaded again after NOSCRIPT)."""

    def __init__(self, client: Any) -> None:
        self.claim = client.register_script(CLAIM)
        self.replace = client.register_script(REPLACE)
        self.delete = client.register_script(DELETE)
        self.heal = client.register_script(HEAL)
        self.fetch = client.register_script(FETCH)
        self.drop = client.register_script(DROP)
        self.walk_set = client.register_script(WALK_SET)
        self.walk_range = client.register_script(WALK_RANGE)
        self.stale = client.register_script(STALE)
        self.after = client.register_script(AFTER)
        self.fresh = client.register_script(FRESH)
