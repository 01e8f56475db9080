-- A ledger as lmfleet 7963f4a wrote it (its own code, a fixed clock), dumped as SQL text; see test_store_upgrade.py.
--
-- PostgreSQL database dump
--


-- Dumped from database version 18.6
-- Dumped by pg_dump version 18.6

SET statement_timeout = 0;
SET lock_timeout = 0;
SET idle_in_transaction_session_timeout = 0;
SET transaction_timeout = 0;
SET client_encoding = 'UTF8';
SET standard_conforming_strings = on;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;
SET xmloption = content;
SET client_min_messages = warning;
SET row_security = off;

SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: budget_keys; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.budget_keys (
    key text NOT NULL
);


--
-- Name: lmfleet_schema; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.lmfleet_schema (
    version integer NOT NULL
);


--
-- Name: rate_windows; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.rate_windows (
    key text NOT NULL,
    window_start double precision NOT NULL,
    n double precision NOT NULL
);


--
-- Name: requests; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.requests (
    id bigint NOT NULL,
    ts double precision NOT NULL,
    model text NOT NULL,
    served_by text NOT NULL,
    route_reason text NOT NULL,
    input_tokens bigint NOT NULL,
    output_tokens bigint NOT NULL,
    latency_ms double precision,
    ttft_ms double precision,
    status text NOT NULL,
    cost_nusd bigint NOT NULL,
    tenant text
);


--
-- Name: requests_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.requests_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: requests_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.requests_id_seq OWNED BY public.requests.id;


--
-- Name: reservations; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.reservations (
    id text NOT NULL,
    key text NOT NULL,
    request_id text NOT NULL,
    amount_nusd bigint NOT NULL,
    created_at double precision NOT NULL,
    expires_at double precision NOT NULL
);


--
-- Name: spend_buckets; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.spend_buckets (
    key text NOT NULL,
    bucket_end bigint NOT NULL,
    nusd bigint NOT NULL
);


--
-- Name: tenant_overrides; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.tenant_overrides (
    name text NOT NULL,
    settings text,
    version bigint NOT NULL,
    updated_at double precision NOT NULL
);


--
-- Name: tenant_slots; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.tenant_slots (
    id text NOT NULL,
    key text NOT NULL,
    expires_at double precision NOT NULL
);


--
-- Name: requests id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.requests ALTER COLUMN id SET DEFAULT nextval('public.requests_id_seq'::regclass);


--
-- Data for Name: budget_keys; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.budget_keys VALUES ('global');
INSERT INTO public.budget_keys VALUES ('tenant:acme');
INSERT INTO public.budget_keys VALUES ('acme:limits');
INSERT INTO public.budget_keys VALUES ('tenant-overrides');


--
-- Data for Name: lmfleet_schema; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.lmfleet_schema VALUES (1);
INSERT INTO public.lmfleet_schema VALUES (2);
INSERT INTO public.lmfleet_schema VALUES (3);
INSERT INTO public.lmfleet_schema VALUES (4);


--
-- Data for Name: rate_windows; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.rate_windows VALUES ('acme:requests', 1764000000, 1);
INSERT INTO public.rate_windows VALUES ('acme:tokens', 1764000000, 812);


--
-- Data for Name: requests; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.requests VALUES (1, 1764000000, 'smollm2', 'provider/acme', 'overflow', 812, 143, 950, 210, 'ok', 420000, 'acme');
INSERT INTO public.requests VALUES (2, 1764000000, 'smollm2', 'local/smollm2', 'local_ok', 20, 40, 120, 30, 'ok', 0, NULL);
INSERT INTO public.requests VALUES (3, 1764000001, 'smollm2', 'local/smollm2', 'local_ok', 10, 20, 80, 20, 'ok', 13000, 'beta');
INSERT INTO public.requests VALUES (4, 1764000002, 'smollm2', 'provider/beta', 'overflow', 5, 7, NULL, NULL, 'error', 0, NULL);


--
-- Data for Name: reservations; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.reservations VALUES ('a232cc36b38c4b31909a8c0ea054dc52', 'global', 'req-2', 300000, 1764000000, 1764000900);


--
-- Data for Name: spend_buckets; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.spend_buckets VALUES ('global', 1764000060, 420000);
INSERT INTO public.spend_buckets VALUES ('tenant:acme', 1764000060, 420000);


--
-- Data for Name: tenant_overrides; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.tenant_overrides VALUES ('acme', '{"limits": {"requests_per_minute": 5}}', 1, 1764000000);


--
-- Data for Name: tenant_slots; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.tenant_slots VALUES ('ca0226f04352423ea4f98b44ab28d680', 'acme', 1764000600);


--
-- Name: requests_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.requests_id_seq', 4, true);


--
-- Name: budget_keys budget_keys_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.budget_keys
    ADD CONSTRAINT budget_keys_pkey PRIMARY KEY (key);


--
-- Name: rate_windows rate_windows_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.rate_windows
    ADD CONSTRAINT rate_windows_pkey PRIMARY KEY (key, window_start);


--
-- Name: requests requests_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.requests
    ADD CONSTRAINT requests_pkey PRIMARY KEY (id);


--
-- Name: reservations reservations_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.reservations
    ADD CONSTRAINT reservations_pkey PRIMARY KEY (id, key);


--
-- Name: spend_buckets spend_buckets_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.spend_buckets
    ADD CONSTRAINT spend_buckets_pkey PRIMARY KEY (key, bucket_end);


--
-- Name: tenant_overrides tenant_overrides_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.tenant_overrides
    ADD CONSTRAINT tenant_overrides_pkey PRIMARY KEY (name);


--
-- Name: tenant_slots tenant_slots_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.tenant_slots
    ADD CONSTRAINT tenant_slots_pkey PRIMARY KEY (id);


--
-- Name: requests_ts; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX requests_ts ON public.requests USING btree (ts);


--
-- Name: reservations_key; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX reservations_key ON public.reservations USING btree (key, expires_at);


--
-- Name: tenant_overrides_version; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tenant_overrides_version ON public.tenant_overrides USING btree (version);


--
-- Name: tenant_slots_key; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tenant_slots_key ON public.tenant_slots USING btree (key, expires_at);


--
-- PostgreSQL database dump complete
--


