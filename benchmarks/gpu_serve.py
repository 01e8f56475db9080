"""lmfleet on a real GPU: the CUDA vLLM engine under ``lmfleet serve`` beside bare vLLM on the same GPU.

Run on a GPU machine where ``tools/gpu_carry.sh install`` put vLLM (CUDA), Ray and lmfleet on python3's path:

    python3 benchmarks/gpu_serve.py --out DIR --steps model,check,start      # then, servers still up:
    python3 benchmarks/gpu_serve.py --out DIR --steps bench,overflow,stop

Steps (state between calls in /tmp/gpu-serve/state.json; servers run in their own sessions until ``stop``):
  model     a random-weight Llama (about 1 B parameters: hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192)
            with SmolLM2's tokenizer (/tmp/gpu-tokenizer), saved in bf16 to /tmp/gpu-model; nothing hub-made.
  check     ``lmfleet check -c fleet.yaml --json`` on the idle GPU: inventory and the memory planner's KV tokens.
  start     the fake provider (DeepSeek's dialect), ``lmfleet serve`` of the fleet file (TP 1, the shape of
            examples/deepseek-4x8-h200.yaml), then bare ``vllm serve`` with the same engine options; each engine
            gets ``--gpu-util`` of the GPU, so both fit at once. The KV tokens each engine reports at start.
  bench     the measurements of benchmarks/bench_gateway.py (lmfleet.testing.serving_paths) against the three paths (bare vLLM, Ray Serve's endpoint,
            the lmfleet gateway): TTFT and output tokens/s at 1 stream (paths in rotation) and at ``--streams``
            (``vllm bench serve``), medians over ``--rounds``; ratios to bare vLLM.
  overflow  a burst of ``--burst`` chat requests through the gateway, more than the engine's ``max_num_seqs``:
            how many the gateway sent to the provider, errors, and ledger rows against answers.
  gate      what ``overflow.prefill_gate`` costs on this engine: ``vllm bench serve`` through the gateway (overflow
            forced off) at ``--streams`` with the gate off and on, alternated per round, for prompts of each of
            ``--gate-prompt-lens`` tokens; medians over ``--rounds``, the gate's setting put back to auto after.
  stop      stops every server started here.
Writes DIR/gpu_serve.json (every figure of the steps run in this call) and DIR/*.log tails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

# FlashInfer is not carried (tools/gpu_carry.sh): vLLM's sampler imports it on CUDA unless told not to.
for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
               "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1",
               "VLLM_USE_FLASHINFER_SAMPLER": "0"}.items():
    os.environ[_k] = _v

WORK = Path("/tmp/gpu-serve")
STATE = WORK / "state.json"
MODEL_DIR = Path("/tmp/gpu-model")
TOKENIZER_DIR = Path("/tmp/gpu-tokenizer")
NAME = "llama-1b"
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")
ADMIN_KEY = "gpu-admin"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model() -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(MODEL_DIR, safe_serialization=True)
    tok.save_pretrained(MODEL_DIR)
    del model
    torch.cuda.empty_cache()
    return {"parameters": params, "vocab": len(tok), "folder_bytes": sum(f.stat().st_size for f in MODEL_DIR.iterdir())}


def engine_options(a) -> dict:
    return {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "max_model_len": a.max_model_len,
            "gpu_memory_utilization": a.gpu_util, "max_num_seqs": a.max_num_seqs, "enable_prefix_caching": True}


def fleet_yaml(st: dict, a) -> str:
    eng = ", ".join(f"{k}: {json.dumps(v)}" for k, v in engine_options(a).items())
    return f"""version: 1
gateway: {{port: {st['gport']}, serve_port: {st['sport']}, admin_key_env: LMFLEET_ADMIN_KEY}}
ledger: {{path: {WORK / 'ledger.sqlite'}}}
models:
  - name: {NAME}
    source: {MODEL_DIR}
    engine: {{{eng}, device: gpu}}
    deployment: {{replicas: 1, max_ongoing_requests: {4 * a.max_num_seqs}, request_timeout_s: 600}}
    cost: {{gpu_hour_usd: 2.10}}
    overflow: {{threshold_ms: {a.threshold_ms}}}
providers:
  - name: fake-deepseek
    base_url: http://127.0.0.1:{st['pport']}/v1
    api_key_env: FAKE_PROVIDER_KEY
    dialect: deepseek
    model_map: {{{NAME}: deepseek-chat}}
    price: {{input_per_1m: 0.27, output_per_1m: 1.10}}
    max_concurrency: 1024
"""


def env() -> dict:
    return {**os.environ, "LMFLEET_ADMIN_KEY": ADMIN_KEY, "FAKE_PROVIDER_KEY": "sk-fake"}


PROCS: dict[int, subprocess.Popen] = {}


def spawn(cmd: list[str], logname: str) -> int:
    p = subprocess.Popen(cmd, env=env(), stdout=(WORK / logname).open("w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    PROCS[p.pid] = p
    return p.pid


def wait_url(url: str, pid: int, logname: str, timeout: float) -> float:
    """Seconds until ``url`` answers 200; exits with the log's tail when the process ends first."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if PROCS[pid].poll() is not None:
            raise SystemExit(f"{logname} exited before {url} answered:\n" + (WORK / logname).read_text()[-4000:])
        time.sleep(1)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s:\n" + (WORK / logname).read_text()[-4000:])


def kv_tokens_in(paths: list[Path]) -> list[int]:
    found = []
    for p in paths:
        try:
            found += [int(m.replace(",", "")) for m in KV_LINE.findall(p.read_text(errors="replace"))]
        except OSError:
            continue
    return found


def check(st: dict, a, res: dict) -> None:
    out = subprocess.run([sys.executable, "-m", "lmfleet.cli.main", "check", "-c", str(WORK / "fleet.yaml"), "--json"],
                         capture_output=True, text=True, env=env(), timeout=300)
    (WORK / "check.log").write_text(out.stdout + out.stderr)
    res["check_rc"] = out.returncode
    try:
        doc = json.loads(out.stdout)
    except json.JSONDecodeError:
        res["check_error"] = (out.stdout + out.stderr)[-2000:]
        return
    res["check"] = doc
    res["planner_kv_tokens"] = next((r["data"]["kv_tokens"] for r in doc.get("results", [])
                                     if "kv_tokens" in (r.get("data") or {})), None)
    log(f"check rc {out.returncode}; planner KV tokens {res['planner_kv_tokens']}")


def start(st: dict, a, res: dict) -> None:
    st["provider_pid"] = spawn([sys.executable, "-m", "lmfleet.testing.fast_openai_server", "--port", str(st["pport"]),
                                "--dialect", "deepseek", "--ttft-ms", "150", "--itl-ms", "4", "--workers", "2"],
                               "provider.log")
    wait_url(f"http://127.0.0.1:{st['pport']}/v1/models", st["provider_pid"], "provider.log", 60)
    st["serve_pid"] = spawn([sys.executable, "-m", "lmfleet.cli.main", "serve", "-c", str(WORK / "fleet.yaml")], "serve.log")
    STATE.write_text(json.dumps(st))
    res["lmfleet_startup_s"] = wait_url(f"http://127.0.0.1:{st['gport']}/ready", st["serve_pid"], "serve.log", 900)
    log(f"lmfleet serve ready after {res['lmfleet_startup_s']:.0f} s")
    opts = engine_options(a)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR), "--served-model-name",
           NAME, "--port", str(st["vport"]), "--disable-log-stats"]
    for k, v in opts.items():
        cmd += [f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", str(v)]
    st["vllm_pid"] = spawn(cmd, "vllm.log")
    STATE.write_text(json.dumps(st))
    res["bare_vllm_startup_s"] = wait_url(f"http://127.0.0.1:{st['vport']}/v1/models", st["vllm_pid"], "vllm.log", 900)
    log(f"bare vLLM ready after {res['bare_vllm_startup_s']:.0f} s")
    res["bare_vllm_cmd"] = " ".join(cmd[1:])
    res["vllm_kv_tokens_bare"] = kv_tokens_in([WORK / "vllm.log"])
    ray_logs = [p for p in Path("/tmp/ray/session_latest/logs").rglob("*") if p.is_file()]
    res["vllm_kv_tokens_lmfleet"] = sorted(set(kv_tokens_in(ray_logs + [WORK / "serve.log"])))
    log(f"KV tokens reported: bare {res['vllm_kv_tokens_bare']}, under lmfleet {res['vllm_kv_tokens_lmfleet']}")


METRICS = ("ttft_p50_ms", "ttft_p99_ms", "output_tok_s", "errors")
"""What ``run_vllm_bench`` reports that the bench and gate tables show, as medians over the rounds."""


def _medians(runs: list[dict]) -> dict[str, float]:
    """Each of :data:`METRICS`' median over ``runs`` (one result per round)."""
    import statistics

    return {m: statistics.median(r[m] for r in runs) for m in METRICS}


def bench(st: dict, a, res: dict) -> None:
    from lmfleet.testing import serving_paths as bg

    targets = [bg.Target("bare vLLM", f"http://127.0.0.1:{st['vport']}/v1", NAME),
               bg.Target("Ray Serve LLM endpoint", f"http://127.0.0.1:{st['sport']}/{NAME}/v1", NAME),
               bg.Target("lmfleet gateway", f"http://127.0.0.1:{st['gport']}/v1", NAME)]
    raw: dict[str, dict[str, list]] = {t.name: {"1": [], "n": []} for t in targets}
    for rnd in range(a.rounds):
        for name, r in asyncio.run(bg.load_c1_rotated(targets, a.requests_1, a.max_tokens, 0.2)).items():
            raw[name]["1"].append(r)
            log(f"round {rnd + 1} {name:24s} c=1: TTFT p50 {r['ttft_p50_ms']:.1f} p99 {r['ttft_p99_ms']:.1f} ms "
                f"{r['output_tok_s']:.0f} tok/s errors {r['errors']}")
        for t in targets:
            r = bg.run_vllm_bench(t, a.streams, a.requests_n, a.max_tokens, str(MODEL_DIR))
            raw[t.name]["n"].append(r)
            log(f"round {rnd + 1} {t.name:24s} c={a.streams}: TTFT p50 {r['ttft_p50_ms']:.1f} p99 "
                f"{r['ttft_p99_ms']:.1f} ms {r['output_tok_s']:.0f} tok/s errors {r['errors']}")
    med = {n: {f"c{c}_{k}": v for c in (1, a.streams) for k, v in _medians(raw[n]["1" if c == 1 else "n"]).items()}
           for n in raw}
    base = med["bare vLLM"]
    for row in med.values():
        for c in (1, a.streams):
            row[f"tok_s_ratio_c{c}"] = row[f"c{c}_output_tok_s"] / base[f"c{c}_output_tok_s"]
            row[f"ttft_p99_ratio_c{c}"] = row[f"c{c}_ttft_p99_ms"] / base[f"c{c}_ttft_p99_ms"]
        row["ttft_p50_added_ms_c1"] = row["c1_ttft_p50_ms"] - base["c1_ttft_p50_ms"]
    res["bench"] = {"streams": a.streams, "max_tokens": a.max_tokens, "rounds": a.rounds, "requests_1": a.requests_1,
                    "requests_n": a.requests_n, "table": med, "raw": raw}
    s = a.streams
    print(f"\n| path | tok/s c=1 | TTFT P50 c=1 (ms) | TTFT P99 c=1 (ms) | tok/s c={s} | TTFT P99 c={s} (ms) "
          f"| tok/s vs bare c=1 | tok/s vs bare c={s} | P99 TTFT c={s} vs bare |\n|---|---|---|---|---|---|---|---|---|")
    for n, r in med.items():
        print(f"| {n} | {r['c1_output_tok_s']:.0f} | {r['c1_ttft_p50_ms']:.1f} | {r['c1_ttft_p99_ms']:.1f} | "
              f"{r[f'c{s}_output_tok_s']:.0f} | {r[f'c{s}_ttft_p99_ms']:.1f} | {r['tok_s_ratio_c1']:.1%} | "
              f"{r[f'tok_s_ratio_c{s}']:.1%} | {r[f'ttft_p99_ratio_c{s}']:.2f}x |", flush=True)


async def burst(st: dict, a) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{st['gport']}/v1", api_key="none", max_retries=0, timeout=600)
    served: Counter = Counter()
    errors: Counter = Counter()

    async def one(i: int) -> None:
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=NAME, messages=[{"role": "user", "content": f"Request {i}: tell a long story."}],
                max_tokens=a.burst_tokens, extra_body={"ignore_eos": True})
            raw.parse()
            served[raw.headers.get("x-lmfleet-served-by", "?")] += 1
        except Exception as e:  # noqa: BLE001 - counted by type
            errors[type(e).__name__] += 1
    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(a.burst)))
    return {"requests": a.burst, "max_tokens": a.burst_tokens, "wall_s": time.monotonic() - t0,
            "served_by": dict(served), "errors": dict(errors)}


def overflow(st: dict, a, res: dict) -> None:
    import httpx

    h = {"authorization": f"Bearer {ADMIN_KEY}"}
    before = httpx.get(f"http://127.0.0.1:{st['gport']}/admin/usage", headers=h, timeout=60).json()
    b = asyncio.run(burst(st, a))
    log(f"burst: {b}")
    after = httpx.get(f"http://127.0.0.1:{st['gport']}/admin/usage", headers=h, timeout=60).json()
    res["overflow"] = {"threshold_ms": a.threshold_ms, "burst": b, "usage_before": before, "usage_after": after}


def gate(st: dict, a, res: dict) -> None:
    import httpx

    from lmfleet.testing import serving_paths as bg

    h = {"authorization": f"Bearer {ADMIN_KEY}"}
    url = f"http://127.0.0.1:{st['gport']}"
    t = bg.Target("lmfleet gateway", f"{url}/v1", NAME)
    raw: dict[str, list] = {}
    try:
        for rnd in range(a.rounds):
            for n in a.gate_prompt_lens:
                for on in ((False, True) if rnd % 2 == 0 else (True, False)):
                    httpx.post(f"{url}/admin/overflow", json={"model": NAME, "mode": "force_off", "prefill_gate": on},
                               headers=h, timeout=30).raise_for_status()
                    r = bg.run_vllm_bench(t, a.streams, a.requests_n, a.max_tokens, str(MODEL_DIR), input_len=n)
                    raw.setdefault(f"{n} {'on' if on else 'off'}", []).append(r)
                    log(f"round {rnd + 1} prompt {n} gate {'on ' if on else 'off'} c={a.streams}: TTFT p50 "
                        f"{r['ttft_p50_ms']:.1f} p99 {r['ttft_p99_ms']:.1f} ms {r['output_tok_s']:.0f} tok/s "
                        f"errors {r['errors']}")
    finally:
        httpx.post(f"{url}/admin/overflow", json={"model": NAME, "mode": "auto", "prefill_gate": "auto"}, headers=h,
                   timeout=30)
    med = {k: _medians(v) for k, v in raw.items()}
    res["gate"] = {"streams": a.streams, "requests": a.requests_n, "max_tokens": a.max_tokens, "rounds": a.rounds,
                   "table": med, "raw": raw}
    print("\n| prompt tokens | gate | tok/s | TTFT P50 (ms) | TTFT P99 (ms) | tok/s on / off |\n|---|---|---|---|---|---|")
    for n in a.gate_prompt_lens:
        off, on = med[f"{n} off"], med[f"{n} on"]
        for name, r in (("off", off), ("on", on)):
            print(f"| {n} | {name} | {r['output_tok_s']:.0f} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                  f"{r['output_tok_s'] / off['output_tok_s']:.1%} |", flush=True)


def stop(st: dict, a, res: dict) -> None:
    for key in ("vllm_pid", "serve_pid", "provider_pid"):
        pid = st.get(key)
        if not pid:
            continue
        try:
            os.killpg(pid, signal.SIGINT)
            for _ in range(60):
                os.kill(pid, 0)
                time.sleep(1)
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    subprocess.run(["ray", "stop", "--force"], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", default="model,check,start,bench,overflow,stop")
    ap.add_argument("--gpu-util", type=float, default=0.40, help="each engine's gpu_memory_utilization")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--threshold-ms", type=int, default=1500, help="the model's overflow.threshold_ms")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-1", type=int, default=12)
    ap.add_argument("--requests-n", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--burst", type=int, default=1000)
    ap.add_argument("--burst-tokens", type=int, default=256)
    ap.add_argument("--gate-prompt-lens", type=int, nargs="+", default=[32, 1024],
                    help="the gate step's prompt sizes (tokens)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    from lmfleet.net import free_port

    st = json.loads(STATE.read_text()) if STATE.exists() else {
        "gport": free_port(), "sport": free_port(), "vport": free_port(), "pport": free_port()}
    (WORK / "fleet.yaml").write_text(fleet_yaml(st, a))
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(a) | {"out": str(a.out)}}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    res["gpu"] = smi.stdout.strip()
    try:
        import torch
        import vllm

        res["versions"] = {"python": sys.version.split()[0], "torch": torch.__version__, "vllm": vllm.__version__,
                           "cuda": torch.version.cuda}
    except Exception as e:  # noqa: BLE001
        res["versions"] = {"error": repr(e)}
    steps = {"model": None, "check": check, "start": start, "bench": bench, "overflow": overflow, "gate": gate,
             "stop": stop}
    try:
        for s in a.steps.split(","):
            log(f"step {s}")
            if s == "model":
                res["model"] = build_model()
                log(f"model: {res['model']}")
            else:
                steps[s](st, a, res)
            STATE.write_text(json.dumps(st))
    except BaseException:
        if "stop" in a.steps.split(","):  # a failed step leaves no server behind
            stop(st, a, res)
        raise
    finally:
        (a.out / "gpu_serve.json").write_text(json.dumps(res, indent=2, default=str))
        for name in ("serve.log", "vllm.log", "check.log", "provider.log"):
            if (WORK / name).exists():
                (a.out / name).write_text((WORK / name).read_text(errors="replace")[-200_000:])


if __name__ == "__main__":
    main()
