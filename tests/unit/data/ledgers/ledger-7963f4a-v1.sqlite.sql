-- A ledger as lmfleet 7963f4a wrote it (its own code, a fixed clock), dumped as SQL text; see test_store_upgrade.py.
BEGIN TRANSACTION;
CREATE TABLE lmfleet_schema (version INTEGER NOT NULL);
INSERT INTO "lmfleet_schema" VALUES(1);
CREATE TABLE requests (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    ts            REAL    NOT NULL,
    model         TEXT    NOT NULL,
    served_by     TEXT    NOT NULL,
    route_reason  TEXT    NOT NULL,
    input_tokens  INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    latency_ms    REAL,
    ttft_ms       REAL,
    status        TEXT    NOT NULL,
    cost_nusd     INTEGER NOT NULL
);
INSERT INTO "requests" VALUES(1,1763913600.0,'smollm2','provider/acme','overflow',100,50,700.0,150.0,'ok',90000);
INSERT INTO "requests" VALUES(2,1763913700.0,'smollm2','local/smollm2','local_ok',12,30,60.0,15.0,'ok',0);
CREATE TABLE reservations (
    id          TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    request_id  TEXT    NOT NULL,
    amount_nusd INTEGER NOT NULL,
    created_at  REAL    NOT NULL,
    expires_at  REAL    NOT NULL,
    PRIMARY KEY (id, key)
);
CREATE TABLE spend_buckets (
    key        TEXT    NOT NULL,
    bucket_end INTEGER NOT NULL,
    nusd       INTEGER NOT NULL,
    PRIMARY KEY (key, bucket_end)
);
INSERT INTO "spend_buckets" VALUES('global',1763913660,90000);
CREATE INDEX requests_ts ON requests (ts);
CREATE INDEX reservations_key ON reservations (key, expires_at);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('requests',2);
COMMIT;
