"""Prove lmfleet check's GPU-facing parts on real GPUs (issue 7): probe, planner bytes, NCCL links.

Needs torch with CUDA, nvidia-ml-py and NCCL; no vLLM, no Ray, no pydantic. Imports only
``lmfleet.check.planner`` and ``lmfleet.cluster.gpu_probe`` (pure Python, from ``src/``); uses
``transformers`` when present to build the models with Hugging Face's own classes. On a GPU host without
lmfleet installed, put the checkout's ``src`` on the path:

    PYTHONPATH=src python benchmarks/gpu_proof.py --out DIR [--models qwen2.5-0.5b,qwen2.5-7b] [--steps probe,weights,...]

NVLink multicast stays off: the script sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 before torch loads.

Steps (56 s on 2x H200, docs/gpu_proof.md holds that run's figures):
  1. probe   - gpu_probe.probe_gpus() against ``nvidia-smi`` (names, uuids, totals, used, compute processes),
               idle and while a second process holds memory on the last GPU: that GPU must turn busy and its
               pid show. Raw NVML answers (v1 and v2 memory info) are saved as unit-test recordings.
  2. weights - Llama/Qwen-shaped models with random weights on GPU 0: bf16 through transformers'
               AutoModelForCausalLM (when importable) and tensor by tensor with HF's shapes; fp8 (e4m3
               linear weights with one fp32 scale per 128x128 block, the rest bf16). The
               torch.cuda.memory_allocated() delta against planner.weight_bytes(): target within 5 %.
  3. kv      - a vLLM-layout KV cache ([2, blocks, 16, kv_heads, head_dim] per layer) in bf16 and fp8:
               bytes per token against planner.kv_bytes_per_token(), exactly; then a flat buffer of the
               planner's bytes/token x tokens must view as that layout with nothing left over.
  4. act     - one decoder layer's forward over 8192 tokens plus fp32 logits of 256 rows: peak memory
               against the planner's activation estimate (reported, not asserted).
  5. plan    - plan_memory() on GPU 0's NVML total, then the plan made real: weights + the planned KV tokens
               allocated, one layer forward on top; what the process uses against vLLM's budget
               (gpu_memory_utilization x cudaMemGetInfo total), and the KV bytes vLLM would get.
  6. nccl    - with 2+ GPUs: NCCL all-reduce between GPU 0 and 1 through torch.distributed, reported as
               lmfleet check reports a node-to-node link (Gbit/s for a 64 MiB payload, ms for 256 KiB);
               then again with CUDA_VISIBLE_DEVICES=0, where the probe must say there is nothing to measure.
Writes DIR/gpu_proof.json (all numbers, ok per step), DIR/nvml_recording_{idle,busy}.json and
DIR/sysinfo.txt (nvidia-smi -q, topo); prints a summary table last; exits 1 if a step failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# NVLink multicast stays off (a program using it can take the host's shared GPUs down): set before torch loads.
for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_k] = _v

from lmfleet.check import planner  # noqa: E402  (after the NCCL settings above; pure Python modules)
from lmfleet.cluster import gpu_probe  # noqa: E402
from lmfleet.net import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

KNOWN = ROOT / "src" / "lmfleet" / "check" / "known_models"
MiB, GiB = 1024**2, 1024**3
SHAPES = {
    "qwen2.5-0.5b": "Qwen--Qwen2.5-0.5B-Instruct.json",
    "qwen2.5-7b": "Qwen--Qwen2.5-7B-Instruct.json",
    "llama-3-8b": "meta-llama--Meta-Llama-3-8B-Instruct.json",
    "qwen2.5-14b": "Qwen--Qwen2.5-14B-Instruct.json",
    "smollm2-135m": "HuggingFaceTB--SmolLM2-135M-Instruct.json",  # for CPU dry runs
}
DEFAULT_MODELS = "qwen2.5-0.5b,qwen2.5-7b,llama-3-8b,qwen2.5-14b"
WEIGHT_TARGET = 0.05  # issue 7: planner weight bytes within 5 % of what torch allocates
DEV = "cuda:0"  # a CPU dry run (tests) points this elsewhere
HOLDER = """
import sys, time, torch
torch.cuda.set_device(int(sys.argv[1]))  # else synchronize() opens a context on GPU 0 too
x = torch.empty(int(sys.argv[2]) * 1024**2, dtype=torch.uint8, device=f"cuda:{sys.argv[1]}")
x.fill_(1); torch.cuda.synchronize(); print("ready", flush=True); time.sleep(600)
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_cfg(name: str) -> dict:
    return json.loads((KNOWN / SHAPES[name]).read_text())


def torch_allocated() -> int:
    import torch

    gc.collect()
    return torch.cuda.memory_allocated(0)


def release() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


# ---- 1. probe vs nvidia-smi -----------------------------------------------------------------------------------

def _smi(query: str, fields: list[str]) -> list[dict]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}={','.join(fields)}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [dict(zip(fields, (x.strip() for x in line.split(",")))) for line in out.strip().splitlines() if line.strip()]


def nvidia_smi() -> list[dict]:
    """nvidia-smi's view: one row per GPU (MiB), with the compute processes it lists on that GPU."""
    fields = ["index", "name", "uuid", "memory.total", "memory.reserved", "memory.used", "memory.free"]
    try:
        rows = _smi("gpu", fields)
    except subprocess.CalledProcessError:  # older drivers do not know memory.reserved
        rows = _smi("gpu", [f for f in fields if f != "memory.reserved"])
    try:
        apps = _smi("compute-apps", ["gpu_uuid", "pid", "process_name", "used_memory"])
    except subprocess.CalledProcessError as e:
        apps = [{"error": e.stderr}]
    out = []
    for r in rows:
        num = {k.replace("memory.", "") + "_mib": int(v) for k, v in r.items() if k.startswith("memory.") and v.isdigit()}
        out.append({"index": int(r["index"]), "name": r["name"], "uuid": r["uuid"], **num,
                    "processes": [{"pid": int(a["pid"]), "name": a["process_name"], "used_mib": a["used_memory"]}
                                  for a in apps if a.get("gpu_uuid") == r["uuid"]]})
    return out


def compare(probe: gpu_probe.NodeGpus, smi: list[dict]) -> list[dict]:
    """One row per GPU: the probe's figures beside nvidia-smi's, with what differs."""
    rows = []
    if len(probe.gpus) != len(smi):
        rows.append({"problem": f"probe sees {len(probe.gpus)} GPUs, nvidia-smi {len(smi)}"})
    for g, s in zip(probe.gpus, smi):
        pids, smi_pids = sorted(p.pid for p in g.processes), sorted(p["pid"] for p in s["processes"])
        row = {"index": g.index, "name": g.name, "smi_name": s["name"], "uuid_match": g.uuid == s["uuid"],
               "total_mib": g.memory_total / MiB, "smi_total_mib": s["total_mib"],
               "used_mib": g.memory_used / MiB, "smi_used_mib": s["used_mib"],
               "reserved_mib": g.memory_reserved / MiB, "smi_reserved_mib": s.get("reserved_mib"),
               "free": g.free, "pids": pids, "smi_pids": smi_pids}
        problems = []
        if g.name != s["name"] or g.uuid != s["uuid"]:
            problems.append("name/uuid differ")
        if abs(g.memory_total / MiB - s["total_mib"]) > 1:
            problems.append(f"total {g.memory_total / MiB:.0f} MiB vs nvidia-smi {s['total_mib']}")
        if abs(g.memory_used / MiB - s["used_mib"]) > 2:  # nvidia-smi rounds to MiB; nothing moves between reads
            problems.append(f"used {g.memory_used / MiB:.0f} MiB vs nvidia-smi {s['used_mib']}")
        if s.get("reserved_mib") is not None and abs(g.memory_reserved / MiB - s["reserved_mib"]) > 1:
            problems.append(f"reserved {g.memory_reserved / MiB:.0f} MiB vs nvidia-smi {s['reserved_mib']}")
        if pids != smi_pids:
            problems.append(f"processes {pids} vs nvidia-smi {smi_pids}")
        row["problems"] = problems
        rows.append(row)
    return rows


def _problems(rows: list[dict]) -> list[str]:
    return [r["problem"] for r in rows if "problem" in r] + [f"GPU {r['index']}: {p}" for r in rows for p in r.get("problems", [])]


def step_probe(out: Path, hold_gib: int) -> dict:
    import pynvml

    res: dict = {}
    idle = gpu_probe.probe_gpus(pynvml)
    smi = nvidia_smi()
    (out / "nvml_recording_idle.json").write_text(json.dumps(gpu_probe.record_nvml(pynvml), indent=1))
    rows = compare(idle, smi)
    res["idle"] = {"probe": idle.to_dict(), "nvidia_smi": smi, "rows": rows, "problems": _problems(rows)}
    last = len(idle.gpus) - 1
    if last < 0:
        return {**res, "ok": False, "error": idle.error or "no GPU"}
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
    rows = compare(busy, smi_busy)
    problems = _problems(rows)
    g = busy.gpus[last]
    if not ready:
        problems.append("the holder process did not allocate")
    if g.free:
        problems.append(f"GPU {last} holds {g.memory_used / GiB:.1f} GiB but the probe calls it free")
    if not all(x.free == y.free for x, y in zip(busy.gpus[:last], idle.gpus[:last])):
        problems.append("other GPUs changed free/busy state")
    if not any(p.pid == holder.pid for p in g.processes):
        problems.append(f"the holder's pid {holder.pid} is not among GPU {last}'s processes")
    res["busy"] = {"gpu": last, "held_gib": hold_gib, "holder_pid": holder.pid, "probe": busy.to_dict(),
                   "nvidia_smi": smi_busy, "rows": rows, "problems": problems}
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


def _is_linear(name: str, shape: tuple[int, ...]) -> bool:
    return name.startswith("layers.") and len(shape) == 2


def build_tensors(cfg: dict, fp8: bool = False) -> dict:
    """Random weights with HF's shapes on DEV. fp8: layer linears in e4m3 with fp32 128x128 block scales (the
    layout of FP8 checkpoints such as DeepSeek-V3 and Qwen-FP8); embeddings, head, norms and biases in bf16."""
    import torch

    out = {}
    for name, shape in hf_shapes(cfg):
        if fp8 and _is_linear(name, shape):
            w = torch.empty(shape, dtype=torch.bfloat16, device=DEV).normal_(0, 0.02)
            out[name] = w.to(torch.float8_e4m3fn)
            del w
            out[name + ".scale"] = torch.ones(((shape[0] + 127) // 128, (shape[1] + 127) // 128), dtype=torch.float32,
                                              device=DEV)
        else:
            out[name] = torch.empty(shape, dtype=torch.bfloat16, device=DEV).normal_(0, 0.02)
    return out


def build_hf(cfg: dict):
    """The model through transformers' own classes, random weights, bf16, on DEV."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if not k.startswith("_")
                                                        and k not in ("model_type", "architectures")})
    with torch.device(DEV):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers 4.x
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model


def step_weights(models: list[str], use_hf: bool) -> dict:
    import torch

    res: dict = {}
    for name in models:
        cfg = load_cfg(name)
        arch = planner.arch_from_config(cfg)
        counts = planner.param_counts(arch)
        r: dict = {"params_planner": counts.total}
        for kind in ("hf_bf16", "bf16", "fp8"):
            if kind == "hf_bf16" and not use_hf:
                continue
            release()
            base = torch_allocated()
            try:
                if kind == "hf_bf16":
                    model = build_hf(cfg)
                    numel = sum(p.numel() for p in model.parameters())
                    nbytes = sum(p.nbytes for p in model.parameters())
                    allocated = torch_allocated() - base
                    r["hf_class"] = type(model).__name__
                    del model
                else:
                    t = build_tensors(cfg, fp8=(kind == "fp8"))
                    numel = sum(v.numel() for k, v in t.items() if not k.endswith(".scale"))
                    nbytes = sum(v.nbytes for v in t.values())
                    allocated = torch_allocated() - base
                    del t
            except Exception as e:  # noqa: BLE001 - transformers missing or too old: the tensor builds still count
                r[kind] = {"error": f"{type(e).__name__}: {e}"}
                log(f"weights {name} {kind}: {type(e).__name__}: {e}")
                continue
            planned = sum(planner.weight_bytes(arch, "bfloat16", "fp8" if kind == "fp8" else None))
            err = (planned - allocated) / allocated
            r[kind] = {"params_torch": numel, "bytes_tensors": nbytes, "bytes_allocated": allocated, "bytes_planner": planned,
                       "rel_error": round(err, 6), "ok": abs(err) <= WEIGHT_TARGET}
            log(f"weights {name} {kind}: torch {allocated / GiB:.3f} GiB ({numel / 1e9:.3f} B params), planner "
                f"{planned / GiB:.3f} GiB ({counts.total / 1e9:.3f} B), error {err:+.3%}")
        release()
        measured = [v for k, v in r.items() if isinstance(v, dict)]
        r["ok"] = bool(measured) and all(v.get("ok") for v in measured if "error" not in v) and "error" not in r.get("bf16", {})
        res[name] = r
    res["ok"] = all(r["ok"] for r in res.values())
    return res


# ---- 3. KV bytes per token --------------------------------------------------------------------------------------

def step_kv(models: list[str], blocks: int = 2048, block_size: int = 16) -> dict:
    import torch

    res: dict = {}
    tokens = blocks * block_size
    for name in models:
        arch = planner.arch_from_config(load_cfg(name))
        shape = (2, blocks, block_size, arch.num_kv_heads, arch.head_dim)
        for kv_dtype, tdt in (("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            release()
            base = torch_allocated()
            caches = [torch.empty(shape, dtype=tdt, device=DEV) for _ in range(arch.num_layers)]
            allocated = torch_allocated() - base
            del caches
            planned = planner.kv_bytes_per_token(arch, kv_dtype, "bfloat16")
            # the reverse direction: the planner's size, allocated flat, must be exactly that layout
            flat = torch.empty(planned * tokens, dtype=torch.uint8, device=DEV)
            try:
                flat.view(tdt).view(arch.num_layers, *shape)
                views = True
            except RuntimeError:
                views = False
            del flat
            r = {"bytes_per_token_torch": allocated / tokens, "bytes_per_token_planner": planned, "tokens": tokens,
                 "planner_buffer_views_as_layout": views, "ok": allocated == planned * tokens and views}
            res[f"{name}/{kv_dtype}"] = r
            log(f"kv {name} {kv_dtype}: torch {allocated / tokens:.0f} B/token, planner {planned} B/token")
    release()
    res["ok"] = all(r["ok"] for r in res.values())
    return res


# ---- 4. activation peak of one step -------------------------------------------------------------------------------

def attention(q, k, v):
    """Causal attention as vLLM runs it (flash, GQA without copying K/V); elsewhere K/V repeated per head."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if q.is_cuda:
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), "flash-gqa"
        except RuntimeError:
            pass
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True), "repeated-kv"


def layer_forward(x, w: dict, nq: int, nkv: int, d: int, seqs: int) -> str:
    """One Llama decoder layer (attention + gated MLP) over all tokens, then fp32 logits for ``seqs`` rows."""
    import torch
    import torch.nn.functional as F

    tokens = x.shape[0]
    with torch.no_grad():
        q = (x @ w["q"].T).view(1, tokens, nq, d).transpose(1, 2)
        k = (x @ w["k"].T).view(1, tokens, nkv, d).transpose(1, 2)
        vv = (x @ w["v"].T).view(1, tokens, nkv, d).transpose(1, 2)
        a, backend = attention(q, k, vv)
        x2 = x + a.transpose(1, 2).reshape(tokens, nq * d) @ w["o"].T
        del q, k, vv, a
        y = x2 + (F.silu(x2 @ w["g"].T) * (x2 @ w["u"].T)) @ w["dn"].T
        logits = (y[-seqs:] @ w["head"].T).float()
        del logits, y, x2
    return backend


def layer_weights(t: dict) -> dict:
    return {"q": t["layers.0.q_proj"], "k": t["layers.0.k_proj"], "v": t["layers.0.v_proj"], "o": t["layers.0.o_proj"],
            "g": t["layers.0.gate_proj"], "u": t["layers.0.up_proj"], "dn": t["layers.0.down_proj"],
            "head": t.get("lm_head", t["embed_tokens"])}


def step_activation(models: list[str], tokens: int, seqs: int = 256) -> dict:
    import torch

    res: dict = {}
    for name in models:
        cfg = load_cfg(name)
        arch = planner.arch_from_config(cfg)
        cfg1 = {**cfg, "num_hidden_layers": 1}
        t = build_tensors(cfg1)
        x = torch.randn(tokens, arch.hidden_size, dtype=torch.bfloat16, device=DEV)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(0)
        base = torch_allocated()
        backend = layer_forward(x, layer_weights(t), arch.num_attention_heads, arch.num_kv_heads, arch.head_dim, seqs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(0) - base
        est = planner.activation_reserve_bytes(arch, max_num_batched_tokens=tokens, max_num_seqs=seqs, enforce_eager=True) - GiB
        res[name] = {"tokens": tokens, "seqs": seqs, "attention": backend, "peak_bytes": peak,
                     "planner_activation_estimate": est, "ratio_estimate_over_peak": round(est / max(peak, 1), 3)}
        log(f"activation {name}: peak {peak / GiB:.3f} GiB, planner estimate {est / GiB:.3f} GiB ({backend})")
        del t, x
        release()
    res["estimate_covers_peak"] = all(r["ratio_estimate_over_peak"] >= 1.0 for r in res.values() if isinstance(r, dict))
    res["ok"] = True  # reported, not asserted: vLLM profiles the real reserve
    return res


# ---- 5. the plan made real ------------------------------------------------------------------------------------------

def nvml_total(index: int = 0) -> tuple[int, int]:
    """(total, driver-reserved) bytes of one GPU, as the probe reads them."""
    import pynvml

    g = gpu_probe.probe_gpus(pynvml).gpus[index]
    return g.memory_total, g.memory_reserved


def step_plan(models: list[str], tokens: int, utilization: float = 0.9, max_model_len: int = 32768) -> dict:
    """Allocate what the planner promises (weights + KV tokens) and run a step: does it hold in vLLM's budget?"""
    import torch

    res: dict = {}
    total, reserved = nvml_total(0)
    for name in models:
        cfg = load_cfg(name)
        arch = planner.arch_from_config(cfg)
        mml = min(max_model_len, arch.max_position_embeddings)
        plan = planner.plan_memory(arch, dtype="bfloat16", gpu_memory_bytes=total, gpu_memory_utilization=utilization,
                                   max_model_len=mml, max_num_batched_tokens=tokens)
        release()
        torch.cuda.reset_peak_memory_stats(0)
        base = torch_allocated()
        usable = planner.plan_memory(arch, dtype="bfloat16", gpu_memory_bytes=total - reserved,
                                     gpu_memory_utilization=utilization, max_model_len=mml, max_num_batched_tokens=tokens)
        r: dict = {"nvml_total": total, "nvml_reserved": reserved, "plan": plan.as_dict(),
                   "plan_on_usable": {k: usable.as_dict()[k] for k in ("budget_bytes_per_gpu", "kv_bytes_per_gpu", "kv_tokens")}}
        t = caches = x = None
        try:
            t = build_tensors(cfg)
            weights = torch_allocated() - base
            shape = (2, plan.kv_tokens // 16, 16, arch.num_kv_heads, arch.head_dim)
            caches = [torch.empty(shape, dtype=torch.bfloat16, device=DEV) for _ in range(arch.num_layers)]
            kv = torch_allocated() - base - weights
            x = torch.randn(tokens, arch.hidden_size, dtype=torch.bfloat16, device=DEV)
            layer_forward(x, layer_weights(t), arch.num_attention_heads, arch.num_kv_heads, arch.head_dim, 256)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(0) - base
            cuda_free, cuda_total = torch.cuda.mem_get_info(0)
            non_torch = (cuda_total - cuda_free) - torch.cuda.memory_reserved(0)
            vllm_budget = int(cuda_total * utilization)
            activation = peak - weights - kv
            vllm_kv = vllm_budget - weights - activation - non_torch  # what vLLM's profile would leave for KV
            r.update({"weights_allocated": weights, "kv_allocated": kv, "peak_allocated": peak,
                      "activation_peak": activation, "non_torch": non_torch, "cuda_total": cuda_total,
                      "process_used": cuda_total - cuda_free, "vllm_budget": vllm_budget, "vllm_kv_bytes": vllm_kv,
                      "planner_kv_bytes": plan.kv_bytes_per_gpu, "kv_rel_error": round((plan.kv_bytes_per_gpu - vllm_kv) / vllm_kv, 5),
                      "kv_rel_error_on_usable": round((usable.kv_bytes_per_gpu - vllm_kv) / vllm_kv, 5),
                      "within_budget": cuda_total - cuda_free <= vllm_budget})
            r["ok"] = r["within_budget"] and abs(weights - plan.weight_bytes_per_gpu) / weights <= WEIGHT_TARGET
            log(f"plan {name}: planner {plan.kv_tokens} KV tokens ({plan.kv_bytes_per_gpu / GiB:.2f} GiB KV), process "
                f"uses {(cuda_total - cuda_free) / GiB:.2f} of vLLM's {vllm_budget / GiB:.2f} GiB budget; vLLM would "
                f"leave {vllm_kv / GiB:.2f} GiB for KV ({r['kv_rel_error']:+.2%})")
        except torch.cuda.OutOfMemoryError as e:
            r.update({"ok": False, "error": f"out of memory: {str(e)[:300]}"})
            log(f"plan {name}: OUT OF MEMORY")
        finally:
            del t, caches, x
            release()
        res[name] = r
    res["ok"] = all(r["ok"] for r in res.values())
    return res


# ---- 6. NCCL all-reduce between GPUs: the intra-node link ------------------------------------------------------------

LINK_PAYLOAD = 64 * MiB
LATENCY_PAYLOAD = 256 * 1024


def link_text(gbps: float, latency_ms: float, payload_bytes: int) -> str:
    """The words lmfleet check uses for a measured link (check/cluster.py: check_links)."""
    return f"{gbps:.2f} Gbit/s ({payload_bytes // MiB} MiB object), {latency_ms:.1f} ms for 256 KiB"


def _nccl_worker(rank: int, world: int, port: int, max_mib: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device(f"cuda:{rank}"))
    rows = []
    sizes = [LATENCY_PAYLOAD] + [MiB * 4**i for i in range(8) if MiB * 4**i <= max_mib * MiB]
    for size in sizes:
        t = torch.ones(size // 2, dtype=torch.bfloat16, device=f"cuda:{rank}")
        for _ in range(5):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        iters = 50 if size <= 64 * MiB else 10
        times = []
        for _ in range(3):  # best of 3 timed batches, as the check takes the best of 3 pulls
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                dist.all_reduce(t)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        dt = min(times)
        algbw = size / dt
        rows.append({"bytes": size, "time_us": round(dt * 1e6, 2), "algbw_GBps": round(algbw / 1e9, 2),
                     "busbw_GBps": round(algbw * 2 * (world - 1) / world / 1e9, 2)})
        del t
    ok = torch.ones(4, device=f"cuda:{rank}") * (rank + 1)
    dist.all_reduce(ok)
    if rank == 0:
        q.put({"rows": rows, "sum_ok": bool((ok == world * (world + 1) / 2).all())})
    dist.barrier()
    dist.destroy_process_group()


def step_nccl(max_mib: int, host: str) -> dict:
    import queue

    import torch
    import torch.multiprocessing as mp

    n = torch.cuda.device_count()
    if n < 2:
        return {"link": None, "text": f"{n} GPU: no GPU pair to measure (an all-reduce needs 2)",
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "ok": True}
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_nccl_worker, args=(r, 2, port, max_mib, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = q.get(timeout=240)
    except queue.Empty:
        got = None
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    if got is None:
        return {"ok": False, "error": f"no result; worker exit codes {[p.exitcode for p in procs]}"}
    rows = got["rows"]
    for r in rows:
        log(f"nccl all-reduce {r['bytes'] / MiB:g} MiB: {r['time_us']} us, algbw {r['algbw_GBps']} GB/s, "
            f"busbw {r['busbw_GBps']} GB/s")
    big = next(r for r in rows if r["bytes"] == LINK_PAYLOAD)
    small = next(r for r in rows if r["bytes"] == LATENCY_PAYLOAD)
    link = {"a": f"{host}:cuda:0", "b": f"{host}:cuda:1", "gbps": round(LINK_PAYLOAD * 8 / (big["time_us"] / 1e6) / 1e9, 2),
            "latency_ms": round(small["time_us"] / 1e3, 4), "payload_bytes": LINK_PAYLOAD}
    return {"gpus": n, "link": link, "text": link_text(link["gbps"], link["latency_ms"], LINK_PAYLOAD), "rows": rows,
            "peak_busbw_GBps": max(r["busbw_GBps"] for r in rows), "sum_ok": got["sum_ok"],
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            "ok": got["sum_ok"] and all(p.exitcode == 0 for p in procs)}


def step_nccl_one_gpu() -> dict:
    """The same step seen with one GPU (CUDA_VISIBLE_DEVICES=0): it must say there is nothing to measure."""
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
        p = subprocess.run([sys.executable, __file__, "--out", d, "--steps", "nccl"], env=env, capture_output=True,
                           text=True, timeout=180)
        rep = json.loads((Path(d) / "gpu_proof.json").read_text())
    r = rep["nccl"]
    return {"gpus": rep["gpus"], "text": r.get("text"), "link": r.get("link"), "exit_code": p.returncode,
            "ok": p.returncode == 0 and rep["gpus"] == 1 and r.get("link") is None and "no GPU pair" in (r.get("text") or "")}


# ---- the run ----------------------------------------------------------------------------------------------------------

def sysinfo(out: Path) -> None:
    cmds = [["date", "-u"], ["uname", "-a"], ["nvidia-smi"], ["nvidia-smi", "topo", "-m"], ["nvidia-smi", "nvlink", "-s"],
            ["nvidia-smi", "-q", "-d", "MEMORY"]]
    with (out / "sysinfo.txt").open("w") as f:
        for c in cmds:
            try:
                p = subprocess.run(c, capture_output=True, text=True, timeout=60)
                f.write(f"$ {' '.join(c)}  (exit {p.returncode})\n{p.stdout}{p.stderr}\n")
            except (OSError, subprocess.TimeoutExpired) as e:
                f.write(f"$ {' '.join(c)}: {e}\n")


def summary(rep: dict) -> str:
    """The table the docs and the closing note carry."""
    lines = [f"machine {rep.get('host')} | {rep.get('gpu_names')} | driver {rep.get('driver')} | torch {rep.get('torch')} "
             f"(CUDA {rep.get('cuda')}) | {rep.get('started')}"]
    pr = rep.get("probe", {})
    for state in ("idle", "busy"):
        for r in pr.get(state, {}).get("rows", []):
            if "index" in r:
                lines.append(f"probe {state:4} GPU {r['index']}: total {r['total_mib']:.0f} MiB (smi {r['smi_total_mib']}), "
                             f"used {r['used_mib']:.0f} MiB (smi {r['smi_used_mib']}), reserved {r['reserved_mib']:.0f} MiB (smi {r['smi_reserved_mib']}), "
                             f"free={r['free']}, pids {r['pids']} (smi {r['smi_pids']}) {'OK' if not r['problems'] else r['problems']}")
    for name, r in rep.get("weights", {}).items():
        if isinstance(r, dict):
            for kind in ("hf_bf16", "bf16", "fp8"):
                k = r.get(kind)
                if k and "error" not in k:
                    lines.append(f"weights {name:13} {kind:7}: torch {k['bytes_allocated']:>14,} B, planner "
                                 f"{k['bytes_planner']:>14,} B, error {k['rel_error']:+.3%}")
    for name, r in rep.get("kv", {}).items():
        if isinstance(r, dict):
            lines.append(f"kv {name:22}: torch {r['bytes_per_token_torch']:.0f} B/token, planner {r['bytes_per_token_planner']} "
                         f"B/token, {'exact' if r['ok'] else 'MISMATCH'}")
    for name, r in rep.get("act", {}).items():
        if isinstance(r, dict):
            lines.append(f"activation {name}: peak {r['peak_bytes'] / GiB:.3f} GiB, planner {r['planner_activation_estimate'] / GiB:.3f} GiB")
    for name, r in rep.get("plan", {}).items():
        if isinstance(r, dict) and "vllm_kv_bytes" in r:
            lines.append(f"plan {name}: planner KV {r['planner_kv_bytes'] / GiB:.2f} GiB vs vLLM-style {r['vllm_kv_bytes'] / GiB:.2f} "
                         f"GiB ({r['kv_rel_error']:+.2%}; {r['kv_rel_error_on_usable']:+.2%} on total-reserved); used {r['process_used'] / GiB:.2f} / budget {r['vllm_budget'] / GiB:.2f} GiB")
        elif isinstance(r, dict) and "error" in r:
            lines.append(f"plan {name}: {r['error'][:120]}")
    nc = rep.get("nccl", {})
    if nc.get("text"):
        lines.append(f"nccl ({nc.get('gpus', 'fewer than 2')} GPUs): {nc.get('text')}; peak busbw {nc.get('peak_busbw_GBps')} GB/s")
    one = rep.get("nccl_one_gpu", {})
    if one.get("text"):
        lines.append(f"nccl 1 GPU: {one['text']}")
    lines.append("steps: " + ", ".join(f"{k}={'ok' if v.get('ok') else 'FAIL'}" for k, v in rep.items()
                                      if isinstance(v, dict) and "ok" in v))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--hold-gib", type=int, default=20, help="memory the busy-GPU holder allocates")
    ap.add_argument("--nccl-max-mib", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8192, help="max_num_batched_tokens of the activation/plan steps")
    ap.add_argument("--no-hf", action="store_true", help="do not build models through transformers")
    ap.add_argument("--steps", default="sysinfo,probe,weights,kv,act,plan,nccl,nccl_one_gpu")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    models = [m for m in args.models.split(",") if m]
    import torch

    host = socket.gethostname()
    report: dict = {"host": host, "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "gpus": torch.cuda.device_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "models": models, "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                                              "NVSHMEM_DISABLE_NVLS", "CUDA_VISIBLE_DEVICES")}}
    node = gpu_probe.probe_gpus()
    report["gpu_names"] = sorted({g.name for g in node.gpus})
    report["driver"] = node.driver_version
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:
        report["transformers"] = None
    use_hf = report["transformers"] is not None and not args.no_hf
    steps = {"sysinfo": lambda: (sysinfo(args.out), {"ok": True})[1],
             "probe": lambda: step_probe(args.out, args.hold_gib),
             "weights": lambda: step_weights(models, use_hf),
             "kv": lambda: step_kv(models),
             "act": lambda: step_activation([m for m in models if "0.5b" not in m] or models, args.tokens),
             "plan": lambda: step_plan([m for m in models if "0.5b" not in m] or models, args.tokens),
             "nccl": lambda: step_nccl(args.nccl_max_mib, host),
             "nccl_one_gpu": step_nccl_one_gpu}
    names = args.steps.split(",")
    for name in names:
        t0 = time.time()
        log(f"step {name}")
        try:
            report[name] = steps[name]()
        except Exception as e:  # noqa: BLE001 - record and go on to the next step
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            log(f"step {name} failed: {type(e).__name__}: {e}")
        report[name]["seconds"] = round(time.time() - t0, 1)
        (args.out / "gpu_proof.json").write_text(json.dumps(report, indent=2, default=str))
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (args.out / "gpu_proof.json").write_text(json.dumps(report, indent=2, default=str))
    ok = all(report[n].get("ok") for n in names)
    print(summary(report), flush=True)
    log(f"{'all steps passed' if ok else 'some step failed'}; report in {args.out / 'gpu_proof.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
