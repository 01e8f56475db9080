-- A ledger as lmfleet 7963f4a wrote it (its own code, a fixed clock), dumped as SQL text; see test_store_upgrade.py.
BEGIN TRANSACTION;
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
    cost_nusd     INTEGER NOT NULL,
    tenant        TEXT
);
INSERT INTO "requests" VALUES(1,1763999950.0,'smollm2','provider/acme','overflow',30,9,400.0,90.0,'ok',20000,'acme');
CREATE INDEX requests_ts ON requests (ts);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('requests',1);
COMMIT;
