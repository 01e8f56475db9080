"""Prove lmfleet check's GPU-facing parts on real GPUs (issue 7): probe, planner bytes, NCCL links.

Needs torch with CUDA, nvidia-ml-py and NCCL; no vLLM, no Ray, no transformers. Imports only
``lmfleet.check.planner`` and ``lmfleet.check.gpu_probe`` (pure Python, from ``src/``).

    python benchmarks/gpu_proof.py --out DIR [--skip-14b] [--nccl-max-mib 1024]

Steps (about 3-6 minutes on one or two H200s):
  1. probe   - gpu_probe.probe_gpus() against ``nvidia-smi`` (names, totals, used), then again while a
               second process holds memory on the last GPU: that GPU must turn busy (and its pid show
               when the container can see it). Raw NVML recordings are saved for unit-test fixtures.
  2. weights - random-weight Llama/Qwen-shaped models (Qwen2.5-0.5B/7B/14B, Llama-3-8B shapes) built
               tensor by tensor with HF's shapes in bf16 on GPU 0; torch.cuda.memory_allocated() delta
               against planner.weight_bytes(), and parameter counts against planner.param_counts().
  3. kv      - a vLLM-layout KV cache ([2, blocks, 16, kv_heads, head_dim] per layer) allocated for N
               blocks: bytes per token against planner.kv_bytes_per_token(), exactly.
  4. act     - one decoder layer's forward over max_num_batched_tokens tokens plus fp32 logits: peak
               memory against the planner's activation estimate (reported, not asserted).
  5. nccl    - with 2+ GPUs: all-reduce bus bandwidth between GPU 0 and 1 (NCCL_NVLS_ENABLE=0).
Writes DIR/gpu_proof.json (all numbers, pass/fail per step) and DIR/nvml_*.json; exits 1 if a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmfleet.check import gpu_probe, planner  # noqa: E402  (pure Python modules, no other lmfleet imports)

KNOWN = ROOT / "src" / "lmfleet" / "check" / "known_models"
MiB, GiB = 1024**2, 1024**3
SHAPES = {
    "qwen2.5-0.5b": "Qwen--Qwen2.5-0.5B-Instruct.json",
    "qwen2.5-7b": "Qwen--Qwen2.5-7B-Instruct.json",
    "llama-3-8b": "meta-llama--Meta-Llama-3-8B-Instruct.json",
    "qwen2.5-14b": "Qwen--Qwen2.5-14B-Instruct.json",
}
HOLDER = """
import sys, time, torch
x = torch.empty(int(sys.argv[2]) * 1024**2, dtype=torch.uint8, device=f"cuda:{sys.argv[1]}")
x.fill_(1); torch.cuda.synchronize(); print("ready", flush=True); time.sleep(600)
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- 1. probe vs nvidia-smi -----------------------------------------------------------------------------------

def nvidia_smi() -> list[dict]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,uuid,memory.total,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.strip().splitlines():
        i, name, uuid, total, used = [x.strip() for x in line.split(",")]
        rows.append({"index": int(i), "name": name, "uuid": uuid, "total_mib": int(total), "used_mib": int(used)})
    return rows


def compare(probe: gpu_probe.NodeGpus, smi: list[dict]) -> list[str]:
    problems = []
    if len(probe.gpus) != len(smi):
        problems.append(f"probe sees {len(probe.gpus)} GPUs, nvidia-smi {len(smi)}")
    for g, s in zip(probe.gpus, smi):
        if g.name != s["name"] or g.uuid != s["uuid"]:
            problems.append(f"GPU {g.index}: probe {g.name}/{g.uuid} vs smi {s['name']}/{s['uuid']}")
        if abs(g.memory_total / MiB - s["total_mib"]) > 1:
            problems.append(f"GPU {g.index}: total {g.memory_total / MiB:.0f} MiB vs smi {s['total_mib']}")
        if abs(g.memory_used / MiB - s["used_mib"]) > 256:  # memory moves between the two reads
            problems.append(f"GPU {g.index}: used {g.memory_used / MiB:.0f} MiB vs smi {s['used_mib']}")
    return problems


def step_probe(out: Path, hold_gib: int) -> dict:
    import pynvml

    res: dict = {}
    idle = gpu_probe.probe_gpus(pynvml)
    smi = nvidia_smi()
    (out / "nvml_recording_idle.json").write_text(json.dumps(gpu_probe.record_nvml(pynvml), indent=1))
    res["idle"] = {"probe": idle.to_dict(), "nvidia_smi": smi, "problems": compare(idle, smi)}
    last = len(idle.gpus) - 1
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(last), str(hold_gib * 1024)], stdout=subprocess.PIPE,
                              text=True)
    try:
        ready = holder.stdout.readline().strip() == "ready"
        busy = gpu_probe.probe_gpus(pynvml)
        smi_busy = nvidia_smi()
        (out / "nvml_recording_busy.json").write_text(json.dumps(gpu_probe.record_nvml(pynvml), indent=1))
    finally:
        holder.kill()
        holder.wait()
    g = busy.gpus[last]
    problems = compare(busy, smi_busy)
    if not ready:
        problems.append("the holder process did not allocate")
    if g.free:
        problems.append(f"GPU {last} holds {g.memory_used / GiB:.1f} GiB but the probe calls it free")
    others_free = all(x.free == y.free for x, y in zip(busy.gpus[:last], idle.gpus[:last]))
    if not others_free:
        problems.append("other GPUs changed free/busy state")
    res["busy"] = {"gpu": last, "held_gib": hold_gib, "holder_pid": holder.pid, "probe": busy.to_dict(),
                   "nvidia_smi": smi_busy, "holder_pid_visible": any(p.pid == holder.pid for p in g.processes),
                   "problems": problems}
    res["ok"] = not res["idle"]["problems"] and not problems
    return res


# ---- 2. weights -------------------------------------------------------------------------------------------------

def hf_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter shapes of HF's LlamaForCausalLM / Qwen2ForCausalLM (Qwen2 has q/k/v biases)."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nq, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim", h // nq)
    qwen = cfg["model_type"] == "qwen2"
    shapes = [("embed_tokens", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes += [(p + "q_proj", (nq * d, h)), (p + "k_proj", (nkv * d, h)), (p + "v_proj", (nkv * d, h)),
                   (p + "o_proj", (h, nq * d)), (p + "gate_proj", (inter, h)), (p + "up_proj", (inter, h)),
                   (p + "down_proj", (h, inter)), (p + "input_layernorm", (h,)), (p + "post_attention_layernorm", (h,))]
        if qwen:
            shapes += [(p + "q_bias", (nq * d,)), (p + "k_bias", (nkv * d,)), (p + "v_bias", (nkv * d,))]
    shapes.append(("norm", (h,)))
    if not cfg.get("tie_word_embeddings"):
        shapes.append(("lm_head", (v, h)))
    return shapes


def step_weights(skip_14b: bool) -> dict:
    import torch

    res = {}
    for name, fname in SHAPES.items():
        if skip_14b and "14b" in name:
            continue
        cfg = json.loads((KNOWN / fname).read_text())
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(0)
        tensors = [torch.empty(s, dtype=torch.bfloat16, device="cuda:0") for _, s in hf_shapes(cfg)]
        allocated = torch.cuda.memory_allocated(0) - base
        numel = sum(t.numel() for t in tensors)
        del tensors
        torch.cuda.empty_cache()
        arch = planner.arch_from_config(cfg)
        planned = sum(planner.weight_bytes(arch, "bfloat16"))
        counts = planner.param_counts(arch)
        err = (planned - allocated) / allocated
        res[name] = {"params_torch": numel, "params_planner": counts.total, "bytes_allocated": allocated,
                     "bytes_planner": planned, "rel_error": round(err, 5), "ok": abs(err) < 0.01}
        log(f"weights {name}: torch {allocated / GiB:.3f} GiB, planner {planned / GiB:.3f} GiB ({err:+.3%})")
    res["ok"] = all(r["ok"] for r in res.values() if isinstance(r, dict))
    return res


# ---- 3. KV bytes per token --------------------------------------------------------------------------------------

def step_kv(blocks: int = 2048, block_size: int = 16) -> dict:
    import torch

    res = {}
    for name, fname in SHAPES.items():
        cfg = json.loads((KNOWN / fname).read_text())
        arch = planner.arch_from_config(cfg)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(0)
        caches = [torch.empty((2, blocks, block_size, arch.num_kv_heads, arch.head_dim), dtype=torch.bfloat16,
                              device="cuda:0") for _ in range(arch.num_layers)]
        per_token = (torch.cuda.memory_allocated(0) - base) / (blocks * block_size)
        del caches
        planned = planner.kv_bytes_per_token(arch, "auto", "bfloat16")
        res[name] = {"bytes_per_token_torch": per_token, "bytes_per_token_planner": planned, "ok": per_token == planned}
        log(f"kv {name}: torch {per_token:.0f} B/token, planner {planned} B/token")
    res["ok"] = all(r["ok"] for r in res.values() if isinstance(r, dict))
    return res


# ---- 4. activation peak of one step -------------------------------------------------------------------------------

def layer_forward(x, w: dict, nq: int, nkv: int, d: int, seqs: int) -> None:
    """One Llama decoder layer (attention + gated MLP) over all tokens, then fp32 logits for ``seqs`` rows."""
    import torch
    import torch.nn.functional as F

    tokens = x.shape[0]
    with torch.no_grad():
        q = (x @ w["q"].T).view(1, tokens, nq, d).transpose(1, 2)
        k = (x @ w["k"].T).view(1, tokens, nkv, d).transpose(1, 2)
        vv = (x @ w["v"].T).view(1, tokens, nkv, d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, vv, is_causal=True, enable_gqa=True)
        x2 = x + a.transpose(1, 2).reshape(tokens, nq * d) @ w["o"].T
        del q, k, vv, a
        y = x2 + (F.silu(x2 @ w["g"].T) * (x2 @ w["u"].T)) @ w["dn"].T
        logits = (y[-seqs:] @ w["head"].T).float()
        del logits, y, x2


def step_activation(tokens: int = 8192, seqs: int = 256) -> dict:
    import torch

    res = {}
    for name in ("qwen2.5-7b", "llama-3-8b"):
        cfg = json.loads((KNOWN / SHAPES[name]).read_text())
        arch = planner.arch_from_config(cfg)
        h, inter, nq, nkv, d = arch.hidden_size, arch.intermediate_size, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
        dev, bf = "cuda:0", torch.bfloat16
        w = {k: torch.randn(s, dtype=bf, device=dev) * 0.02 for k, s in
             {"q": (nq * d, h), "k": (nkv * d, h), "v": (nkv * d, h), "o": (h, nq * d), "g": (inter, h),
              "u": (inter, h), "dn": (h, inter), "head": (arch.vocab_size, h)}.items()}
        x = torch.randn(tokens, h, dtype=bf, device=dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(0)
        base = torch.cuda.memory_allocated(0)
        layer_forward(x, w, nq, nkv, d, seqs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(0) - base
        est = planner.activation_reserve_bytes(arch, max_num_batched_tokens=tokens, max_num_seqs=seqs, enforce_eager=True) - GiB
        res[name] = {"tokens": tokens, "peak_bytes": peak, "planner_activation_estimate": est,
                     "ratio_estimate_over_peak": round(est / peak, 3)}
        log(f"activation {name}: peak {peak / GiB:.2f} GiB, planner estimate {est / GiB:.2f} GiB")
        del w, x
        torch.cuda.empty_cache()
    res["estimate_covers_peak"] = all(r["ratio_estimate_over_peak"] >= 1.0 for r in res.values() if isinstance(r, dict))
    res["ok"] = True  # reported, not asserted: vLLM profiles the real reserve
    return res


# ---- 5. NCCL all-reduce between 2 GPUs ----------------------------------------------------------------------------

def _nccl_worker(rank: int, world: int, port: int, max_mib: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    size = MiB
    while size <= max_mib * MiB:
        t = torch.ones(size // 2, dtype=torch.bfloat16, device=f"cuda:{rank}")
        for _ in range(3):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        iters = 20 if size <= 64 * MiB else 5
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        busbw = size / dt * 2 * (world - 1) / world / 1e9
        rows.append({"bytes": size, "time_us": round(dt * 1e6, 1), "algbw_GBps": round(size / dt / 1e9, 2),
                     "busbw_GBps": round(busbw, 2)})
        size *= 4
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def step_nccl(max_mib: int) -> dict:
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s); the all-reduce probe needs 2", "ok": True}
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_nccl_worker, args=(r, 2, port, max_mib, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=300)
    for p in procs:
        p.join(60)
    for r in rows:
        log(f"nccl all-reduce {r['bytes'] // MiB} MiB: {r['time_us']} us, bus bandwidth {r['busbw_GBps']} GB/s")
    return {"rows": rows, "peak_busbw_GBps": max(r["busbw_GBps"] for r in rows), "gbps": max(r["busbw_GBps"] for r in rows) * 8,
            "ok": all(p.exitcode == 0 for p in procs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--skip-14b", action="store_true")
    ap.add_argument("--hold-gib", type=int, default=20, help="memory the busy-GPU holder allocates")
    ap.add_argument("--nccl-max-mib", type=int, default=1024)
    ap.add_argument("--steps", default="probe,weights,kv,act,nccl")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    report: dict = {"host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    steps = {"probe": lambda: step_probe(args.out, args.hold_gib), "weights": lambda: step_weights(args.skip_14b),
             "kv": step_kv, "act": step_activation, "nccl": lambda: step_nccl(args.nccl_max_mib)}
    for name in args.steps.split(","):
        t0 = time.time()
        log(f"step {name}")
        try:
            report[name] = steps[name]()
        except Exception as e:  # noqa: BLE001 - record and go on to the next step
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            log(f"step {name} failed: {e}")
        report[name]["seconds"] = round(time.time() - t0, 1)
        (args.out / "gpu_proof.json").write_text(json.dumps(report, indent=2, default=str))
    ok = all(report[n].get("ok") for n in args.steps.split(","))
    log(f"{'all steps passed' if ok else 'some step failed'}; report in {args.out / 'gpu_proof.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
