"""bench_gpu.py --profile: one optimizer step per workload under torch.profiler, a trace file and
a few summary lines (docs/gpus.md, "Running the GPU checks").

The summary reads the profiler's per-op totals: the top ops by self time on the device (kernels,
on CUDA) or on the host (CPU), and shares of the profiled step's wall time spent in communication
(ops or kernels named after a collective or its library), in the optimizer (the
`Optimizer.step#...` range torch records around every `optimizer.step()`), and, on CUDA, with no
kernel running (the step's time minus the kernels' summed busy time: host overhead and syncs), and
the host's time inside ops (high with the device idle: the step is bound by the host).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Names of collectives and their libraries' ops and kernels (not "broadcast": aten::broadcast_tensors is no collective).
COMMUNICATION = ("nccl", "gloo", "c10d::", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter")
TOP = 8


@dataclass(frozen=True)
class OpTime:
    """One op's (or kernel's) totals over the profiled step, in microseconds."""

    name: str
    kernel: bool  # a device-side event (kernel, copy), not a host op or annotation
    self_host_us: float
    self_device_us: float
    host_us: float  # including the ops it called
    device_us: float  # including the kernels its ops launched


def summarize(ops: list[OpTime], step_us: float, on_device: bool, top: int = TOP) -> list[str]:
    """The printed summary of one profiled step of `step_us` wall microseconds."""

    def self_us(op: OpTime) -> float:
        return op.self_device_us if on_device else op.self_host_us

    kernels, host_ops = [op for op in ops if op.kernel], [op for op in ops if not op.kernel]

    def share(us: float) -> str:
        return f"{100 * us / step_us:.1f}%" if step_us > 0 else "-"

    where = "device" if on_device else "host"
    ranked = sorted((op for op in (kernels if on_device else host_ops) if self_us(op) > 0), key=self_us, reverse=True)[:top]
    lines = [f"top {top} by self {where} time: " + "; ".join(f"{op.name[:60]} {share(self_us(op))}" for op in ranked)]
    def is_comm(op: OpTime) -> bool:
        return any(word in op.name.lower() for word in COMMUNICATION)

    optimizer = [op for op in host_ops if op.name.startswith("Optimizer.step#")]
    comm_line = f"communication: host {share(sum(op.self_host_us for op in host_ops if is_comm(op)))}"
    optim_line = f"optimizer step: host {share(sum(op.host_us for op in optimizer))}"
    if on_device:
        busy_us = sum(op.self_device_us for op in kernels)
        comm_line += f", device {share(sum(op.self_device_us for op in kernels if is_comm(op)))}"
        optim_line += f", device {share(sum(op.device_us for op in optimizer))}"
        host_us = sum(op.self_host_us for op in host_ops)
        lines += [comm_line, optim_line, f"device idle: {share(max(step_us - busy_us, 0.0))} (step minus kernel time)",
                  f"host in ops: {share(host_us)} (their self times: launches, Python inside ranges, syncs)"]
    else:
        lines += [comm_line, optim_line]
    return lines


def op_times(prof: torch.profiler.profile) -> list[OpTime]:
    """Per-name totals, host ops and device events apart (a `record_function` range is recorded on
    both sides under one name, which `key_averages` would merge)."""
    totals: dict[tuple[str, bool], list[float]] = {}
    for e in prof.events():
        kernel = e.device_type != torch.autograd.DeviceType.CPU and not getattr(e, "is_user_annotation", False)
        if e.device_type != torch.autograd.DeviceType.CPU and not kernel:
            continue  # the device-side copy of an annotation range: not kernel time
        t = totals.setdefault((e.name, kernel), [0.0, 0.0, 0.0, 0.0])
        t[0] += e.self_cpu_time_total
        t[1] += e.self_device_time_total
        t[2] += e.cpu_time_total
        t[3] += e.device_time_total
    return [OpTime(name, kernel, *t) for (name, kernel), t in totals.items()]


class StepProfiler:
    """`start()` before a step, `stop()` after it (CUDA-synchronised): writes
    `<directory>/<name>.json.gz` and prints the summary. Callable from a trainer's callbacks."""

    def __init__(self, directory: Path, name: str, device: torch.device) -> None:
        self.directory, self.name, self.device = directory, name, device
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities)
        self.t0 = 0.0

    def start(self) -> None:
        self.prof.start()
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - self.t0
        self.prof.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        trace = self.directory / f"{re.sub(r'[^A-Za-z0-9]+', '_', self.name).strip('_')}.json.gz"
        self.prof.export_chrome_trace(str(trace))
        print(f"\nprofile of one step, {self.name} ({wall_s * 1e3:.0f} ms, trace {trace}):")
        for line in summarize(op_times(self.prof), wall_s * 1e6, self.device.type == "cuda"):
            print(f"  {line}")
