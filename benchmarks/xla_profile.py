"""Where a step's time goes on the device, from a JAX profiler trace (``jax.profiler.start_trace``).

On a TPU the trace has a plane ``/device:TPU:0`` with the lines ``XLA Modules`` (one event per
program run: ``name``, ``start_ns``, ``duration_ns``) and ``XLA Ops`` (one event per HLO op run, named
like ``%convolution_reduce_fusion.3 = bf16[8,1024,2736]{...} fusion(...)``), read through
``jax.profiler.ProfileData`` (layout checked on a v5e, jax 0.10.2, 2026-12-05). :func:`summarize`
turns the trace of ``num_steps`` steps into per-step numbers: the device's busy time (the union of
program runs), programs per step and the largest ones, the op time by category (matmul, attention
scores and kernels, copy/transpose, collective, other), and the top ops.

A TPU fuses most matmuls into ``fusion.N`` ops whose names say nothing (the JAX twin's all did on
2026-12-07). :class:`FusionIndex` reads the optimized HLO text of the programs a mode ran (XLA's
``--xla_dump_to`` dump, ``*after_optimizations.txt``; ``tpu_step.py`` writes it) and calls a fusion a
matmul when its fused computation, or one that computation calls, holds a ``dot`` or ``convolution``:
the categories then mean the same in every mode, whatever XLA named the op.

On CPU there is no device plane: programs run as XLA:CPU thunks on host threads. Then the
``device`` part is ``None`` and the ops are the thunk events (their ``hlo_op`` stat), which is
enough to see the largest ones but not a busy time.
"""

from __future__ import annotations

import glob
import os
import re
from collections import defaultdict
from dataclasses import dataclass

CATEGORIES = ("matmul", "attention", "copy/transpose", "collective", "other")
_MATMUL_OPCODES = ("dot", "convolution")
# attention kernels as custom-calls: the project's Pallas flash kernels (tpudist_flash_attention*), JAX's
# splash attention (splash_mha_fwd*, ...)
_ATTENTION_KERNEL = re.compile(r"flash_attention|splash|attention")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COPIES = ("copy", "transpose", "bitcast", "reshape", "copy-start", "copy-done", "dynamic-update-slice")


def parse_op(name: str) -> tuple[str, str, list[tuple[int, ...]]]:
    """``(short name, HLO opcode, output shapes)`` of an ``XLA Ops`` event name; opcode and shapes
    are empty where the name is a bare instruction name (XLA:CPU thunks)."""
    head, sep, rest = name.partition(" = ")
    short = head.strip().lstrip("%")
    if not sep:
        return short, "", []
    match = re.search(r"\s([a-z][\w\-]*)\(", " " + rest)
    opcode = match.group(1) if match else ""
    shape_text = rest[:match.start()] if match else rest
    shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", shape_text)]
    return short, opcode, shapes


def categorize(short: str, opcode: str, shapes: list, seq: int, hlo_category: str = "",
               fused_matmul: bool | None = None) -> str:
    """One of :data:`CATEGORIES`. An op is "attention" when an output has rank >= 3 and ends in
    ``(seq, seq)`` (XLA's scores; weights are 2-d, so ``dim == seq`` does not confuse them) or it is an
    attention kernel's custom-call; "matmul" when its fusion holds a dot or convolution (``fused_matmul``,
    from :class:`FusionIndex`), or else when XLA's category or the name says convolution/dot (TPU XLA
    emits dots as convolutions)."""
    if seq and any(len(s) >= 3 and s[-2:] == (seq, seq) for s in shapes):
        return "attention"
    if opcode == "custom-call" and _ATTENTION_KERNEL.search(short):
        return "attention"
    if fused_matmul:
        return "matmul"
    text = f"{hlo_category} {short} {opcode}".lower()
    if "convolution" in text or re.search(r"\bdot\b|dot[._]|matmul", text):
        return "matmul"
    if any(c in text for c in _COLLECTIVES):
        return "collective"
    if "data formatting" in text or opcode in _COPIES or re.match(r"(copy|transpose)\b|copy[._]|transpose[._]", short):
        return "copy/transpose"
    return "other"


# -- fusions that hold a matmul, from the programs' HLO text -------------------------------------------------
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # a computation's first line
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLS = re.compile(r"calls=(\{[^}]*\}|%?[\w.\-]+)")


def fusions(hlo_text: str) -> dict[str, tuple[str, bool]]:
    """``{fusion instruction name: (its result type, whether it holds a matmul)}`` for an HLO module's text:
    a fusion holds one when its fused computation, or a computation that one calls (nested fusions),
    has a ``dot`` or ``convolution`` instruction."""
    opcodes: dict = defaultdict(set)  # computation -> its instructions' opcodes
    called: dict = defaultdict(list)  # computation -> the computations its instructions call
    fusion_calls: dict = {}  # fusion instruction -> (result type, the computations it calls)
    current = None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "\t")):
            header = _HEADER.match(line)
            current = header.group(1) if header else None
            continue
        instruction = _INSTRUCTION.match(line)
        if current is None or not instruction:
            continue
        name, rest = instruction.groups()
        _, opcode, _ = parse_op(f"{name} = {rest}")
        opcodes[current].add(opcode)
        calls = _CALLS.search(rest)
        targets = re.findall(r"[\w.\-]+", calls.group(1).replace("%", "")) if calls else []
        called[current] += targets
        if opcode == "fusion":
            fusion_calls[name] = (result_type(f"{name} = {rest}"), targets)
    memo: dict = {}

    def holds(computation: str, seen=frozenset()) -> bool:
        if computation not in memo:
            memo[computation] = bool(opcodes[computation] & set(_MATMUL_OPCODES)) or any(
                holds(c, seen | {computation}) for c in called[computation] if c not in seen)
        return memo[computation]

    return {name: (rtype, any(holds(c) for c in targets)) for name, (rtype, targets) in fusion_calls.items()}


@dataclass(frozen=True, slots=True)
class FusionIndex:
    """Which fusion ops hold a matmul, over the HLO modules a mode ran. Op names are per program: a name
    two programs give to different fusions is told apart by its result type (layout included), and
    where even that is ambiguous the index has no answer (the op falls back to its name)."""

    by_key: dict  # (name, result type) -> set of verdicts
    by_name: dict  # name -> set of verdicts
    modules: int = 0

    @classmethod
    def from_texts(cls, texts) -> "FusionIndex":
        by_key, by_name, n = defaultdict(set), defaultdict(set), 0
        for text in texts:
            n += 1
            for name, (rtype, matmul) in fusions(text).items():
                by_key[(name, rtype)].add(matmul)
                by_name[name].add(matmul)
        return cls(dict(by_key), dict(by_name), n)

    def holds_matmul(self, name: str, rtype: str = "") -> bool | None:
        """True or False where the HLO says, None where no module (or more than one, differently) has it."""
        for verdicts in (self.by_key.get((name, rtype)), self.by_name.get(name)):
            if verdicts is not None and len(verdicts) == 1:
                return next(iter(verdicts))
        return None


def load_hlo_texts(dump_dir: str, since: float = 0.0) -> list[str]:
    """The optimized HLO modules XLA dumped under ``dump_dir`` (``--xla_dump_to``, ``--xla_dump_hlo_as_text``)
    from ``since`` (a ``time.time()``) on: one mode's programs, not those of the modes before it."""
    texts = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "**", "*after_optimizations.txt"), recursive=True)):
        if os.path.getmtime(path) >= since:
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    return texts


_WHAT_STATS = ("tf_op", "source", "source_info", "op_name")  # stats a profile may name an op's source by


def what_of(long_name: str, stats: dict) -> str:
    """What made an op, where the profile says: a stat that names its source (JAX's op name stack, e.g.
    ``jit(step)/transpose(jvp(embedding))/scatter-add``), else the ``op_name`` of the metadata in its
    HLO text; "" where neither is there. Op names like ``fusion.80`` are per program, so this is what
    tells two programs' ops of one name apart, and a fusion's origin."""
    for key in _WHAT_STATS:
        value = stats.get(key)
        if value:
            return str(value)
    match = re.search(r'op_name="([^"]*)"', long_name)
    return match.group(1) if match else ""


def _stats(event) -> dict:
    try:
        return dict(event.stats)
    except (TypeError, ValueError):  # stats this binding cannot turn into Python values
        return {}


def _union_ns(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(trace_dir: str, num_steps: int, seq: int = 0, top: int = 12, hlo_texts=()) -> dict:
    """Per-step summary of the trace(s) under ``trace_dir`` (see the module docstring); ``hlo_texts``: the
    optimized HLO of the programs that ran (:func:`load_hlo_texts`), to find the matmuls inside fusions."""
    index = FusionIndex.from_texts(hlo_texts)
    from jax.profiler import ProfileData

    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        return {"error": f"no *.xplane.pb under {trace_dir}"}
    modules: list = []
    ops: list = []
    device_planes, source = [], "device"
    data_planes: list = []
    for path in paths:
        data = ProfileData.from_file(path)
        data_planes += list(data.planes)
        for plane in data.planes:
            lines = {line.name: line for line in plane.lines}
            if plane.name.startswith("/device:") and "XLA Modules" in lines:
                device_planes.append(plane.name)
                modules += [(e.name, e.start_ns, e.duration_ns) for e in lines["XLA Modules"].events]
                if "XLA Ops" in lines:
                    ops += [(e.name, e.duration_ns, _stats(e)) for e in lines["XLA Ops"].events]
        if not device_planes:  # XLA:CPU: thunk events on host threads carry an hlo_op stat
            source = "host thunks (no device plane)"
            for plane in data.planes:
                for line in plane.lines:
                    for e in line.events:
                        stats = _stats(e)
                        if "hlo_op" in stats:
                            ops.append((str(stats["hlo_op"]), e.duration_ns, stats))
    out: dict = {"source": source, "device_planes": device_planes, "steps": num_steps}
    steps = _annotated_steps(data_planes)
    if modules and steps:
        out["timeline"] = timeline(steps[-1], modules)
    if modules:
        busy = _union_ns([(start, start + dur) for _, start, dur in modules])
        by_module: dict = defaultdict(lambda: [0, 0.0])
        for name, _, dur in modules:
            by_module[name][0] += 1
            by_module[name][1] += dur
        out["device"] = {"busy_s_per_step": busy / 1e9 / num_steps,
                         "programs_per_step": len(modules) / num_steps,
                         "programs": [{"name": n, "runs_per_step": c / num_steps, "s_per_step": t / 1e9 / num_steps}
                                      for n, (c, t) in sorted(by_module.items(), key=lambda kv: -kv[1][1])[:8]]}
    else:
        out["device"] = None
    per_op: dict = defaultdict(lambda: {"count": 0, "ns": 0.0, "flops": 0.0, "category": "", "opcode": "",
                                        "shape": "", "what": ""})
    copy_types: dict = defaultdict(lambda: [0, 0.0])  # (opcode, result type with its layout) -> runs, ns
    stat_keys: set = set()
    fused_matmul_ops: set = set()
    categories = dict.fromkeys(CATEGORIES, 0.0)
    flops_by_category = dict.fromkeys(CATEGORIES, 0.0)
    for name, dur, stats in ops:
        # the event name is the HLO text on a v5e; where it is a bare name, a long_name stat may hold the text
        long_name = name if " = " in name else str(stats.get("long_name", name))
        short, opcode, shapes = parse_op(long_name if " = " in long_name else name)
        fused = index.holds_matmul(short, result_type(long_name)) if opcode in ("fusion", "") else None
        category = categorize(short, opcode, shapes, seq, str(stats.get("hlo_category", "")), fused)
        if fused:
            fused_matmul_ops.add(short)
        stat_keys.update(stats)
        what = what_of(long_name, stats)
        # one name in two programs is two ops: told apart by their program where the profile names it, else
        # by their sources
        row = per_op[(short, what, stats.get("hlo_module") or stats.get("program_id") or "")]
        row["what"] = what
        row["count"] += 1
        row["ns"] += dur
        row["category"], row["opcode"] = category, opcode
        row["shape"] = "x".join(map(str, shapes[0])) if len(shapes) == 1 else ("tuple" if shapes else "")
        flops = stats.get("flops") or stats.get("model_flops") or 0
        if isinstance(flops, (int, float)):
            row["flops"] += flops
            flops_by_category[category] += flops
        categories[category] += dur
        if category == "copy/transpose":
            copy_types[(opcode, result_type(long_name))][0] += 1
            copy_types[(opcode, result_type(long_name))][1] += dur
    total = sum(categories.values())
    out["hlo_modules"] = index.modules
    out["fused_matmul_ops"] = len(fused_matmul_ops)  # op names the HLO, not the name, made matmuls
    out["ops_s_per_step"] = total / 1e9 / num_steps
    out["categories"] = {k: {"s_per_step": v / 1e9 / num_steps, "share": v / total if total else 0.0}
                         for k, v in categories.items()}
    matmul_ns = categories["matmul"]
    if flops_by_category["matmul"] and matmul_ns:
        out["matmul_tflops_from_trace"] = flops_by_category["matmul"] / matmul_ns / 1e3
    ranked = sorted(per_op.items(), key=lambda kv: -kv[1]["ns"])

    out["op_stat_keys"] = sorted(stat_keys)  # what this profile's op events carry (a new backend's may differ)

    def rows(items):
        return [{"name": short, "what": r["what"], "category": r["category"], "opcode": r["opcode"], "shape": r["shape"],
                 "runs_per_step": r["count"] / num_steps, "s_per_step": r["ns"] / 1e9 / num_steps,
                 "share": r["ns"] / total if total else 0.0} for (short, *_), r in items[:top]]

    out["top_ops"] = rows(ranked)
    # where the layout changes go: a program's edges, reshapes of flat storages, transposes XLA kept
    out["top_copies"] = rows([(n, r) for n, r in ranked if r["category"] == "copy/transpose"])
    # the same copies summed by what they make: a layout change repeated per layer shows as one row
    out["copies_by_type"] = [{"opcode": op, "type": t, "runs_per_step": c / num_steps, "s_per_step": ns / 1e9 / num_steps}
                             for (op, t), (c, ns) in sorted(copy_types.items(), key=lambda kv: -kv[1][1])[:top]]
    return out


def result_type(long_name: str) -> str:
    """The result type of an ``XLA Ops`` event's HLO text, its layout included (``bf16[8,16,1024,64]{3,2,1,0
    :T(8,128)(2,1)}``); "" where the name is bare or the result a tuple."""
    head, sep, rest = long_name.partition(" = ")
    if not sep or rest.startswith("("):
        return ""
    return rest.split(" ", 1)[0]


STEP_ANNOTATION = "tpu_step.step"  # the host-side TraceAnnotation around each profiled step (tpu_step.profile)


def _annotated_steps(planes) -> list[tuple[float, float]]:
    """(start_ns, end_ns) of each ``STEP_ANNOTATION`` event on the host planes, in order."""
    spans = []
    for plane in planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            spans += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events if e.name == STEP_ANNOTATION]
    return sorted(spans)


def timeline(step: tuple[float, float], modules: list) -> dict:
    """The device's programs within one step (``(start_ns, end_ns)`` on the host's clock, which the
    profiler aligns the device's to): each program's start from the step's start and the device's idle
    time before it, and the idle time from the last program's end to the step's end. Where the host's
    time goes when the device waits: before the first program (recording the step's first graph), between
    two programs (the host recording the next one after the device finished the last) or after the last
    (reading the results)."""
    start, end = step
    inside = sorted((s, d, name) for name, s, d in modules if start <= s <= end)
    events, cursor = [], start
    for s, d, name in inside:
        events.append({"name": name, "start_ms": (s - start) / 1e6, "ms": d / 1e6,
                       "idle_before_ms": max(0.0, s - cursor) / 1e6})
        cursor = max(cursor, s + d)
    return {"step_ms": (end - start) / 1e6, "programs": events, "idle_after_ms": max(0.0, end - cursor) / 1e6}


def format_summary(summary: dict, wall_s: float, model_flops: float) -> list[str]:
    """Lines for the log: busy vs wall, programs, categories, top ops. ``wall_s`` is the step's wall time
    (median of the timed steps), ``model_flops`` the step's model FLOPs (for an achieved matmul rate)."""
    if "error" in summary:
        return [f"    profile: {summary['error']}"]
    lines = []
    dev = summary["device"]
    if dev is None:
        lines.append("    no device plane (CPU): device busy time not measured; ops below are XLA:CPU thunks")
    else:
        busy = dev["busy_s_per_step"]
        lines.append(f"    device busy {busy * 1e3:.1f} ms/step of {wall_s * 1e3:.1f} ms wall "
                     f"({busy / wall_s * 100:.0f}%); host/dispatch/idle gap {(wall_s - busy) * 1e3:.1f} ms; "
                     f"{dev['programs_per_step']:.1f} programs/step")
        lines.append("    programs: " + "; ".join(
            f"{p['name']} x{p['runs_per_step']:.1f} {p['s_per_step'] * 1e3:.1f} ms" for p in dev["programs"][:5]))
    tl = summary.get("timeline")
    if tl is not None:
        parts = [f"idle {p['idle_before_ms']:.1f} | {p['name']} {p['ms']:.1f}" for p in tl["programs"]]
        lines.append(f"    the last profiled step ({tl['step_ms']:.1f} ms on the host), device timeline in ms: "
                     + (" | ".join(parts) + f" | idle to the step's end {tl['idle_after_ms']:.1f}" if parts
                        else "no program started inside it (clocks not aligned?)"))
    cats = summary["categories"]
    if summary.get("hlo_modules"):
        lines.append(f"    fusions read from the HLO of {summary['hlo_modules']} programs: "
                     f"{summary['fused_matmul_ops']} fused ops hold a matmul")
    else:
        lines.append("    no HLO text read (no dump, or every program came from a cache): matmuls found by op "
                     "name only")
    lines.append(f"    op time {summary['ops_s_per_step'] * 1e3:.1f} ms/step: " + ", ".join(
        f"{k} {v['s_per_step'] * 1e3:.1f} ms ({v['share'] * 100:.0f}%)" for k, v in cats.items() if v["s_per_step"]))
    matmul_s = cats["matmul"]["s_per_step"]
    if "matmul_tflops_from_trace" in summary:
        lines.append(f"    matmul ops run at {summary['matmul_tflops_from_trace']:.1f} TFLOP/s (the trace's flops "
                     "stats)")
    elif matmul_s and dev is not None:
        lines.append(f"    model FLOPs / matmul-op time = {model_flops / matmul_s / 1e12:.1f} TFLOP/s (an upper bound "
                     "on the matmuls' rate: attention's FLOPs run in 'attention' ops)")
    lines += [_op_line(op) for op in summary["top_ops"]]
    shown = {op["name"] for op in summary["top_ops"]}
    copies = [op for op in summary.get("top_copies", ()) if op["name"] not in shown]
    if copies:
        lines.append("    largest copy/transpose ops besides those:")
        lines += [_op_line(op) for op in copies]
    if summary.get("copies_by_type"):
        lines.append("    copy/transpose time by what the op makes (its type and layout), all runs summed:")
        lines += [f"      {c['s_per_step'] * 1e3:8.2f} ms x{c['runs_per_step']:<5.1f} {c['opcode'] or '-':<12} "
                  f"{c['type'][:90]}" for c in summary["copies_by_type"]]
    return lines


def _op_line(op: dict) -> str:
    return (f"      {op['s_per_step'] * 1e3:8.2f} ms {op['share'] * 100:5.1f}% x{op['runs_per_step']:<5.1f} "
            f"{op['category']:<16} {op['opcode'] or '-':<12} {op['shape']:<22} {op['name'][:60]}"
            + (f"  <- {op['what'][-90:]}" if op.get("what") else ""))
