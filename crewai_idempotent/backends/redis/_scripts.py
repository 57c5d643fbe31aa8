"""The Lua scripts that make every write to a Redis ledger one atomic step.

The layout: each record is a hash (`status`, `token`, `revision`, `doc`) under
`<prefix>r:<key>`, and each status has a sorted set `<prefix>i:<STATUS>` of keys scored by
their last update. The keys of the package's own documents (`crewai-idempotent/...`) are
also members of `<prefix>docs`, all scored 0, so a prefix of them is a ZRANGEBYLEX.
A script reads and writes in one step, which Redis runs atomically, so nothing is read in
one round trip and written in another. Each script is idempotent: one whose effect is
already stored reports success, so a script sent again after a lost reply cannot turn a
landed write into a refusal.
"""

from ...ledger._backend import DOCUMENTS

# KEYS[1] the record; KEYS[2] the index of the new status; KEYS[3] the documents' index.
# ARGV: key, status, token, revision, updated_at, doc, resent (1 when sent again after a lost
# reply: finding exactly our record then means the first send landed; owner ids are random,
# so no one else's record is ever identical). Returns nil if stored, else the holder.
CLAIM = f"""
local held = redis.call('HGET', KEYS[1], 'doc')
if held then
    if ARGV[7] == '1' and held == ARGV[6] then return false end
    return held
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'token', ARGV[3], 'revision', ARGV[4],
           'doc', ARGV[6])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
if string.sub(ARGV[1], 1, {len(DOCUMENTS)}) == '{DOCUMENTS}' then
    redis.call('ZADD', KEYS[3], 0, ARGV[1])
end
return false
"""

# KEYS[1] the record; KEYS[2..5] the PENDING, COMMITTED, FAILED, UNCERTAIN indexes.
# ARGV: key, current token, current revision, status, token, revision, updated_at, doc.
# A record already equal to the new one counts as replaced: an earlier send of this same
# write landed and its reply was lost (no other writer produces an identical record: each
# carries its time and a random owner id).
REPLACE = """
local held = redis.call('HMGET', KEYS[1], 'status', 'token', 'revision', 'doc')
if held[2] ~= ARGV[2] or held[3] ~= ARGV[3] then
    if held[2] == ARGV[5] and held[3] == ARGV[6] and held[4] == ARGV[8] then return 1 end
    return 0
end
local index = {PENDING = KEYS[2], COMMITTED = KEYS[3], FAILED = KEYS[4], UNCERTAIN = KEYS[5]}
redis.call('HSET', KEYS[1], 'status', ARGV[4], 'token', ARGV[5], 'revision', ARGV[6],
           'doc', ARGV[8])
if held[1] ~= ARGV[4] then redis.call('ZREM', index[held[1]], ARGV[1]) end
redis.call('ZADD', index[ARGV[4]], ARGV[7], ARGV[1])
return 1
"""

# KEYS as for REPLACE, then KEYS[6] the documents' index; ARGV: key, token, revision.
DELETE = """
local held = redis.call('HMGET', KEYS[1], 'status', 'token', 'revision')
if held[2] ~= ARGV[2] or held[3] ~= ARGV[3] then return 0 end
local index = {PENDING = KEYS[2], COMMITTED = KEYS[3], FAILED = KEYS[4], UNCERTAIN = KEYS[5]}
redis.call('DEL', KEYS[1])
redis.call('ZREM', index[held[1]], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
return 1
"""
