-- Claim identity. `claims` counts the claims of a job and never decreases (a snooze, a release
-- or a replay leaves it alone, where `attempts` is refunded or reset), so (id, claims) names
-- one claim among all of a job's claims: every write after the claim is fenced on it, and a
-- stale write (a lost lease, a retried write whose reply was lost) matches no later claim.
-- `snoozes` counts the runs that ended in aioq.Retry; each also added one to max_attempts.
ALTER TABLE @schema.jobs
    ADD COLUMN claims integer NOT NULL DEFAULT 0,
    ADD COLUMN snoozes integer NOT NULL DEFAULT 0;
