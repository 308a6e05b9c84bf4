-- Queue limits and pauses, read by every worker, so the whole fleet obeys them. A queue with
-- no row here (or with no limit set and not paused) is claimed by the plain claim statement and
-- pays nothing for this; a limited queue's claims lock its row, so they take turns, and count
-- what they may take in a fresh snapshot under that lock.

CREATE TABLE @schema.queues (
    name text PRIMARY KEY,
    max_running integer CONSTRAINT queues_max_running_check CHECK (max_running >= 1),
    rate_limit integer CONSTRAINT queues_rate_limit_check CHECK (rate_limit >= 1),
    rate_period interval CONSTRAINT queues_rate_period_check CHECK (rate_period > interval '0'),
    paused boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT queues_rate_pair CHECK ((rate_limit IS NULL) = (rate_period IS NULL))
);

-- Claims of rate-limited queues, counted per slot of a tenth of the period. A claim counts
-- every slot that overlaps the last period, so the count never falls short of the claims
-- really made in any window of that length (it may exceed them by up to one slot).
CREATE TABLE @schema.queue_claims (
    queue text NOT NULL,
    slot_start timestamptz NOT NULL,
    slot_end timestamptz NOT NULL,
    claims integer NOT NULL,
    PRIMARY KEY (queue, slot_start)
);
