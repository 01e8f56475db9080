"""reserve+settle per request, one thread: lmfleet.store (DB-API: sqlite3, psycopg) vs a SQLAlchemy Core 2.1 candidate
running the same transactions, with statements built per call and built once (bind parameters).

    pip install sqlalchemy; PYTHONPATH=src:. python docs/benchmarks/store_sqlalchemy_2026-12-03.py 1000
"""
import statistics, sys, tempfile, time, uuid
from pathlib import Path
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as lite_insert
from lmfleet.store import GLOBAL, Cap, PostgresSpendStore, SqliteSpendStore, UsageRecord
from lmfleet.testing.pg_server import PgServer

CAPS = [Cap(GLOBAL, 3600.0, 10**15), Cap(GLOBAL, 86400.0, 10**16)]
ROW = UsageRecord(model="m", served_by="provider/acme", route_reason="overflow", input_tokens=812,
                  output_tokens=143, status="ok", latency_ms=950.0, ttft_ms=210.0)
md = sa.MetaData()
res = sa.Table("reservations", md, sa.Column("id", sa.Text, primary_key=True), sa.Column("key", sa.Text, primary_key=True),
               sa.Column("request_id", sa.Text), sa.Column("amount_nusd", sa.BigInteger), sa.Column("created_at", sa.Float),
               sa.Column("expires_at", sa.Float))
bk = sa.Table("spend_buckets", md, sa.Column("key", sa.Text, primary_key=True), sa.Column("bucket_end", sa.BigInteger, primary_key=True),
              sa.Column("nusd", sa.BigInteger))
req = sa.Table("requests", md, sa.Column("id", sa.BigInteger, primary_key=True), sa.Column("ts", sa.Float), sa.Column("model", sa.Text),
               sa.Column("served_by", sa.Text), sa.Column("route_reason", sa.Text), sa.Column("input_tokens", sa.BigInteger),
               sa.Column("output_tokens", sa.BigInteger), sa.Column("latency_ms", sa.Float), sa.Column("ttft_ms", sa.Float),
               sa.Column("status", sa.Text), sa.Column("cost_nusd", sa.BigInteger), sa.Column("tenant", sa.Text))
keys_t = sa.Table("budget_keys", md, sa.Column("key", sa.Text, primary_key=True))

class SaPrebuilt:
    """The same transactions with every statement built once (bind parameters), so only execution is timed."""
    def __init__(self, url, pg):
        self.pg = pg
        self.eng = sa.create_engine(url, pool_size=2) if pg else sa.create_engine(url, isolation_level="AUTOCOMMIT")
        if not pg:
            sa.event.listen(self.eng, "connect", lambda dbapi, rec: dbapi.execute("PRAGMA synchronous=NORMAL"))
        bp = sa.bindparam
        held = sa.select(sa.func.coalesce(sa.func.sum(res.c.amount_nusd), 0)).where(res.c.key == bp("k"), res.c.expires_at > bp("now")).scalar_subquery()
        s1 = sa.select(sa.func.coalesce(sa.func.sum(bk.c.nusd), 0)).where(bk.c.key == bp("k1"), bk.c.bucket_end > bp("since1")).scalar_subquery()
        s2 = sa.select(sa.func.coalesce(sa.func.sum(bk.c.nusd), 0)).where(bk.c.key == bp("k2"), bk.c.bucket_end > bp("since2")).scalar_subquery()
        self.read = sa.select(held, s1, s2)
        self.lock = sa.select(keys_t.c.key).where(keys_t.c.key.in_([GLOBAL])).order_by(keys_t.c.key).with_for_update()
        self.ins_res = res.insert()
        self.del_res = res.delete().where(res.c.id == bp("rid"))
        ins = pg_insert if pg else lite_insert
        st = ins(bk)
        self.upsert = st.on_conflict_do_update(index_elements=[bk.c.key, bk.c.bucket_end], set_={"nusd": bk.c.nusd + st.excluded.nusd})
        self.ins_req = req.insert()
    def reserve(self, rid, amount, caps):
        now = time.time()
        with self.eng.connect() as c:
            if self.pg:
                tx = c.begin(); c.execute(self.lock).all()
            else:
                c.exec_driver_sql("BEGIN IMMEDIATE")
            c.execute(self.read, {"k": GLOBAL, "now": now, "k1": caps[0].key, "since1": now - caps[0].window_s,
                                  "k2": caps[1].key, "since2": now - caps[1].window_s}).one()
            i = uuid.uuid4().hex
            c.execute(self.ins_res, {"id": i, "key": GLOBAL, "request_id": rid, "amount_nusd": amount, "created_at": now, "expires_at": now + 900})
            if self.pg: tx.commit()
            else: c.exec_driver_sql("COMMIT")
        return i
    def settle(self, i, actual, r):
        now = time.time()
        with self.eng.connect() as c:
            if self.pg: tx = c.begin()
            else: c.exec_driver_sql("BEGIN")
            c.execute(self.del_res, {"rid": i})
            c.execute(self.upsert, {"key": GLOBAL, "bucket_end": (int(now) // 60 + 1) * 60, "nusd": actual})
            c.execute(self.ins_req, {"ts": now, "model": r.model, "served_by": r.served_by, "route_reason": r.route_reason,
                      "input_tokens": r.input_tokens, "output_tokens": r.output_tokens, "latency_ms": r.latency_ms,
                      "ttft_ms": r.ttft_ms, "status": r.status, "cost_nusd": actual, "tenant": r.tenant})
            if self.pg: tx.commit()
            else: c.exec_driver_sql("COMMIT")


class SaStore:
    def __init__(self, url, pg):
        self.pg = pg
        self.eng = sa.create_engine(url, pool_size=2) if pg else sa.create_engine(url, isolation_level="AUTOCOMMIT")
        if not pg:
            sa.event.listen(self.eng, "connect", lambda dbapi, rec: dbapi.execute("PRAGMA synchronous=NORMAL"))
    def reserve(self, rid, amount, caps):
        now = time.time()
        with self.eng.connect() as c:
            if self.pg:
                tx = c.begin()
                c.execute(sa.select(keys_t.c.key).where(keys_t.c.key.in_([GLOBAL])).order_by(keys_t.c.key).with_for_update()).all()
            else:
                c.exec_driver_sql("BEGIN IMMEDIATE")
            held = sa.select(sa.func.coalesce(sa.func.sum(res.c.amount_nusd), 0)).where(res.c.key == GLOBAL, res.c.expires_at > now).scalar_subquery()
            subs = [sa.select(sa.func.coalesce(sa.func.sum(bk.c.nusd), 0)).where(bk.c.key == cp.key, bk.c.bucket_end > now - cp.window_s).scalar_subquery() for cp in caps]
            row = c.execute(sa.select(held, *subs)).one()
            i = uuid.uuid4().hex
            c.execute(res.insert().values(id=i, key=GLOBAL, request_id=rid, amount_nusd=amount, created_at=now, expires_at=now + 900))
            if self.pg: tx.commit()
            else: c.exec_driver_sql("COMMIT")
        return i
    def settle(self, i, actual, r):
        now = time.time()
        ins = pg_insert if self.pg else lite_insert
        with self.eng.connect() as c:
            if self.pg: tx = c.begin()
            else: c.exec_driver_sql("BEGIN")
            c.execute(res.delete().where(res.c.id == i))
            st = ins(bk).values(key=GLOBAL, bucket_end=(int(now) // 60 + 1) * 60, nusd=actual)
            c.execute(st.on_conflict_do_update(index_elements=[bk.c.key, bk.c.bucket_end], set_={"nusd": bk.c.nusd + st.excluded.nusd}))
            c.execute(req.insert().values(ts=now, model=r.model, served_by=r.served_by, route_reason=r.route_reason, input_tokens=r.input_tokens,
                      output_tokens=r.output_tokens, latency_ms=r.latency_ms, ttft_ms=r.ttft_ms, status=r.status, cost_nusd=actual, tenant=r.tenant))
            if self.pg: tx.commit()
            else: c.exec_driver_sql("COMMIT")

def loop(reserve, settle, n):
    for i in range(50): settle(reserve(f"w{i}", 1000, CAPS), 900, ROW)
    out = []
    for i in range(n):
        t = time.perf_counter(); settle(reserve(f"r{i}", 210000, CAPS), 180000, ROW); out.append((time.perf_counter() - t) * 1000)
    out.sort(); return statistics.median(out), out[int(len(out) * .99)]

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
d = Path(tempfile.mkdtemp())
raw = SqliteSpendStore(d / "a.sqlite")
print("sqlite raw      P50 %.3f P99 %.3f ms" % loop(raw.reserve, lambda r, a, x: raw.settle(r, a, x), n))
SqliteSpendStore(d / "b.sqlite").close()
s = SaStore(f"sqlite:///{d/'b.sqlite'}", False)
print("sqlite sqlalchemy P50 %.3f P99 %.3f ms" % loop(s.reserve, s.settle, n))
SqliteSpendStore(d / "c.sqlite").close()
s = SaPrebuilt(f"sqlite:///{d/'c.sqlite'}", False)
print("sqlite sqlalchemy prebuilt P50 %.3f P99 %.3f ms" % loop(s.reserve, s.settle, n))
srv = PgServer.start()
try:
    raw = PostgresSpendStore(srv.url, pool_size=2)
    print("pg raw          P50 %.3f P99 %.3f ms" % loop(raw.reserve, lambda r, a, x: raw.settle(r, a, x), n))
    s = SaStore(srv.url.replace("postgresql://", "postgresql+psycopg://"), True)
    print("pg sqlalchemy   P50 %.3f P99 %.3f ms" % loop(s.reserve, s.settle, n))
    s = SaPrebuilt(srv.url.replace("postgresql://", "postgresql+psycopg://"), True)
    print("pg sqlalchemy prebuilt P50 %.3f P99 %.3f ms" % loop(s.reserve, s.settle, n))
finally:
    srv.destroy()
