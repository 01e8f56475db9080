-- A ledger as lmfleet 7963f4a wrote it (its own code, a fixed clock), dumped as SQL text; see test_store_upgrade.py.
BEGIN TRANSACTION;
CREATE TABLE lmfleet_schema (version INTEGER NOT NULL);
INSERT INTO "lmfleet_schema" VALUES(1);
INSERT INTO "lmfleet_schema" VALUES(2);
INSERT INTO "lmfleet_schema" VALUES(3);
INSERT INTO "lmfleet_schema" VALUES(4);
CREATE TABLE rate_windows (
    key          TEXT NOT NULL,
    window_start REAL NOT NULL,
    n            REAL NOT NULL,
    PRIMARY KEY (key, window_start)
);
INSERT INTO "rate_windows" VALUES('acme:requests',1764000000.0,1.0);
INSERT INTO "rate_windows" VALUES('acme:tokens',1764000000.0,812.0);
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
, tenant TEXT);
INSERT INTO "requests" VALUES(1,1764000000.0,'smollm2','provider/acme','overflow',812,143,950.0,210.0,'ok',420000,'acme');
INSERT INTO "requests" VALUES(2,1764000000.0,'smollm2','local/smollm2','local_ok',20,40,120.0,30.0,'ok',0,NULL);
INSERT INTO "requests" VALUES(3,1764000001.0,'smollm2','local/smollm2','local_ok',10,20,80.0,20.0,'ok',13000,'beta');
INSERT INTO "requests" VALUES(4,1764000002.0,'smollm2','provider/beta','overflow',5,7,NULL,NULL,'error',0,NULL);
CREATE TABLE reservations (
    id          TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    request_id  TEXT    NOT NULL,
    amount_nusd INTEGER NOT NULL,
    created_at  REAL    NOT NULL,
    expires_at  REAL    NOT NULL,
    PRIMARY KEY (id, key)
);
INSERT INTO "reservations" VALUES('2a836feb1192492f9011ba247827286c','global','req-2',300000,1764000000.0,1764000900.0);
CREATE TABLE spend_buckets (
    key        TEXT    NOT NULL,
    bucket_end INTEGER NOT NULL,
    nusd       INTEGER NOT NULL,
    PRIMARY KEY (key, bucket_end)
);
INSERT INTO "spend_buckets" VALUES('global',1764000060,420000);
INSERT INTO "spend_buckets" VALUES('tenant:acme',1764000060,420000);
CREATE TABLE tenant_overrides (
    name       TEXT PRIMARY KEY,
    settings   TEXT,
    version    INTEGER NOT NULL,
    updated_at REAL NOT NULL
);
INSERT INTO "tenant_overrides" VALUES('acme','{"limits": {"requests_per_minute": 5}}',1,1764000000.0);
CREATE TABLE tenant_slots (
    id         TEXT PRIMARY KEY,
    key        TEXT NOT NULL,
    expires_at REAL NOT NULL
);
INSERT INTO "tenant_slots" VALUES('646fd43851334edba0b2c592b2b7f7b4','acme',1764000600.0);
CREATE INDEX requests_ts ON requests (ts);
CREATE INDEX reservations_key ON reservations (key, expires_at);
CREATE INDEX tenant_slots_key ON tenant_slots (key, expires_at);
CREATE INDEX tenant_overrides_version ON tenant_overrides (version)
;
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('requests',4);
COMMIT;
