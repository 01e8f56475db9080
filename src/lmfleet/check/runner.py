"""Run every check for a fleet: config-only checks always, cluster checks unless offline."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from lmfleet.check.cluster import (
    Link,
    check_gpu_fit,
    check_inventory,
    check_links,
    gather_inventory,
    measure_links,
)
from lmfleet.check.disaggregation import check_kv_transfer_path, check_kv_transfer_size
from lmfleet.check.exposure import check_replica_exposure
from lmfleet.check.hardware import GpuModel, Hardware, bandwidth_for, gpu_model, hardware_from_config
from lmfleet.check.memory import check_host_memory, check_memory, no_arch
from lmfleet.check.model_files import find_model_files, tokenizer_location
from lmfleet.check.parallelism import check_expert_parallel, check_parallelism, valid_tp_sizes
from lmfleet.check.planner import PlanError, arch_from_config
from lmfleet.check.result import CheckResult, failed, passed, skipped
from lmfleet.check.timeouts import LoadAssumptions, check_timeouts
from lmfleet.check.tokenizer import check_tokenizer
from lmfleet.cluster.connect import LocalHead, connect, resolve_ray_address
from lmfleet.cluster.gpu_probe import DEFAULT_BUSY_FRACTION
from lmfleet.cluster.nodes import probe_rdma_nodes
from lmfleet.config.models import FleetConfig


OWN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class CheckOptions:
    offline: bool = False
    address: str | None = None  # --address; else RAY_ADDRESS, cluster.address, or a throwaway local Ray
    gpu: GpuModel | None = None  # --gpu: assumed GPU when nothing was measured (else the file's cluster.gpu)
    busy_fraction: float = DEFAULT_BUSY_FRACTION
    link_payload_mib: int = 64
    load: LoadAssumptions = field(default_factory=LoadAssumptions)
    build_builtin: bool = True  # build builtin:* models into the cache if missing


@contextlib.contextmanager
def ray_connection(address: str | None, progress: Callable[[str], None]) -> Iterator[str]:
    """Join ``address`` (already resolved), or start a throwaway single-node Ray that is shut down afterwards."""
    import ray

    if address:
        progress(f"joining Ray at {address}")
        connect(address, configure_logging=False)
        desc = f"Ray cluster at {address}"
    else:
        progress("starting a throwaway local Ray for the inventory")
        connect(None, local=LocalHead(num_cpus=2), configure_logging=False)
        desc = "throwaway local Ray"
    try:
        yield desc
    finally:
        ray.shutdown()


def assumed_gpu(cfg: FleetConfig, opts: CheckOptions) -> GpuModel | None:
    """The GPU to plan for when none is measured: ``--gpu``, else the fleet file's ``cluster.gpu``."""
    if opts.gpu is not None:
        return opts.gpu
    return gpu_model(cfg.cluster.gpu) if cfg.cluster.gpu else None


def model_checks(cfg: FleetConfig, hw: Hardware, opts: CheckOptions) -> list[CheckResult]:
    """Per-model checks that need no cluster: files, parallelism, memory, timeouts, tokenizer.

    A fleet whose nodes have GPUs is planned for those GPUs, never for the CPU of the machine running the check;
    when their model is unknown (offline, no ``cluster.gpu`` or ``--gpu``) the memory plan is skipped."""
    out: list[CheckResult] = []
    on_gpu = hw.gpu_memory_bytes is not None
    gpus_unknown = hw.has_gpus and not on_gpu
    for m in cfg.models:
        try:
            files = find_model_files(m.source, build_builtin=opts.build_builtin)
        except Exception as e:  # noqa: BLE001 - building a builtin model can fail in many ways
            out.append(failed("model.files", m.name, f"cannot prepare {m.source}: {type(e).__name__}: {e}",
                              "run `lmfleet serve` once on a machine with the builtin models' packages"))
            continue
        plan = None
        pools = [(pm.model_copy(update={"name": f"{m.name}/{role}"}) if role else pm) for role, pm in m.pool_models()]
        if files.config is None:
            out.append(skipped("model.files", m.name, files.origin))
            out.append(no_arch(m, files.origin))
            out += [r for pm in pools for r in check_expert_parallel(pm, None)]
        else:
            out.append(passed("model.files", m.name, f"config.json from {files.origin}"))
            try:
                arch = arch_from_config(files.config)
            except PlanError as e:
                out.append(failed("model.arch", m.name, str(e), "point source at a complete checkpoint"))
                arch = None
            if arch is not None:
                block = ((files.config.get("quantization_config") or {}).get("weight_block_size") or [None])[0]
                if m.engine.quantization not in (None, "fp8"):
                    block = None
                for pm in pools:  # the model itself, or its prefill and decode pools (plan: the last, decode)
                    out += check_parallelism(pm, arch, hw, weight_block=block) + check_expert_parallel(pm, arch)
                    if gpus_unknown:
                        out.append(skipped("memory.fit", pm.name, "the fleet file describes GPU nodes but not their "
                                           "GPU model; set cluster.gpu (e.g. h200) or pass --gpu to plan memory"))
                        mem, plan = [], None
                    else:
                        mem, plan = check_memory(pm, arch, hw, valid_tp_sizes(arch))
                    out += mem
                if plan is not None and m.deployment.disaggregation is not None:
                    out.append(check_kv_transfer_size(m, plan, cfg.cluster.min_link_gbps))
                if plan is not None and not on_gpu and not hw.has_gpus and not hw.measured:
                    import psutil

                    out.append(check_host_memory(m, plan, psutil.virtual_memory().total))
        out += check_timeouts(m, cfg, plan, opts.load, on_gpu=on_gpu or hw.has_gpus,
                              bandwidth_gbs=bandwidth_for(hw.gpu_name))
        own = files.folder if files.folder and any((files.folder / f).exists() for f in OWN_TOKENIZER_FILES) else None
        out += check_tokenizer(m, cfg, tokenizer_location(m, files), model_config=files.config,
                               generation_config=files.generation_config, reference_location=own and str(own))
    return out


def run_checks(cfg: FleetConfig, opts: CheckOptions, progress: Callable[[str], None] = lambda _m: None
               ) -> tuple[list[CheckResult], dict[str, Any]]:
    """All checks; returns the results and facts for the JSON report (hardware, links)."""
    extra: dict[str, Any] = {"mode": "offline" if opts.offline else "cluster"}
    gpu = assumed_gpu(cfg, opts)
    if opts.offline:
        hw = hardware_from_config(cfg, gpu)
        results = [skipped("cluster", "cluster", f"--offline: no Ray; hardware {hw.note}")]
        results += check_inventory(hw) + check_gpu_fit(cfg, hw)
        links: list[Link] = []
        results += check_kv_transfer_path(cfg, hw, links, None)
    else:
        address = resolve_ray_address(opts.address, cfg)
        with ray_connection(address, progress) as desc:
            progress("asking every node's NVML through Ray tasks")
            hw = gather_inventory(busy_fraction=opts.busy_fraction)
            progress("measuring links between nodes")
            links = measure_links(payload_bytes=opts.link_payload_mib * 1024**2) if len(hw.nodes) > 1 else []
            split = any(m.deployment.disaggregation for m in cfg.models) and len(hw.nodes) > 1
            rdma = probe_rdma_nodes() if split else None
        results = [passed("cluster", "cluster", f"{desc}: {hw.note}")]
        results += check_inventory(hw) + check_gpu_fit(cfg, hw) + check_links(cfg, hw, links)
        results += check_kv_transfer_path(cfg, hw, links, rdma)
        results += check_replica_exposure(cfg, [n.probe.extra["ip"] for n in hw.nodes
                                                if n.probe is not None and n.probe.extra.get("ip")],
                                          joined=address is not None)
    extra["hardware"] = [{"name": n.name, "gpus": n.gpus_total, "free": n.gpus_free, "gpu": n.gpu_name,
                          "gpu_memory_bytes": n.gpu_memory_bytes, "source": n.source,
                          "probe": n.probe.to_dict() if n.probe else None} for n in hw.nodes]
    extra["links"] = [vars(link) for link in links]
    if gpu is not None and hw.gpu_memory_bytes is None:
        # measured cluster without GPUs, planning for the GPU given by --gpu or cluster.gpu
        hw = Hardware(tuple(replace(n, gpu_memory_bytes=gpu.memory_bytes, gpu_name=gpu.name) for n in hw.nodes),
                      hw.measured, hw.note)
    progress("checking models (files, parallelism, memory, timeouts, tokenizer)")
    results += model_checks(cfg, hw, opts)
    return results, extra
