-- flotilla's store on PostgreSQL (decision 0044). Applied once, in one transaction, under an
-- advisory lock; `migrations` records that it was.

-- Every tree of the typed store: byte keys and values, scanned in key order (bytea compares
-- bytewise).
CREATE TABLE records (
    tree  text  NOT NULL,
    key   bytea NOT NULL,
    value bytea NOT NULL,
    PRIMARY KEY (tree, key)
);

-- The lease: exactly one row. Its times are the database's clock, never a client's; its epoch
-- only grows, and every write of the leader is fenced by it.
CREATE TABLE lease (
    id          boolean     PRIMARY KEY DEFAULT true CHECK (id),
    holder      text        NOT NULL,
    epoch       bigint      NOT NULL CHECK (epoch >= 0),
    acquired_at timestamptz NOT NULL,
    renewed_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL
);

-- Nobody holds it yet: expired long ago, at epoch 0, so the first coordinator takes epoch 1.
INSERT INTO lease (id, holder, epoch, acquired_at, renewed_at, expires_at)
VALUES (true, '', 0, to_timestamp(0), to_timestamp(0), to_timestamp(0));

-- The coordinators that share this database, each seen when it renews or tries to take over.
CREATE TABLE coordinators (
    id        text        PRIMARY KEY,
    client_id text        NOT NULL,
    last_seen timestamptz NOT NULL
);
