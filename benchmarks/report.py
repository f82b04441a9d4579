"""benchmarks/RESULTS.md and its plots, generated from the benchmarks' results.

    python benchmarks/report.py run              # run the benchmarks (small settings, ~10 min) and render
    python benchmarks/report.py run collectives  # run one of them again, then render
    python benchmarks/report.py render           # RESULTS.md and plots/*.png from benchmarks/results/
    python benchmarks/report.py ingest NAME OUTPUT.txt --command "..." [--started ISO] [--seconds S]

Each benchmark prints its tables (``train_step.py`` also writes JSON); ``run`` keeps what it
printed and what this script parsed out of it as ``benchmarks/results/<name>.json``, with the
command, the date and the machine. ``render`` reads only those JSON files, so the page can be
rebuilt (or restyled) without running anything. ``ingest`` stores the output of a run made by hand.
``tpu_step.json`` is not run here: ``benchmarks/tpu_step.py --json benchmarks/results/tpu_step.json``
writes it on a TPU, and ``render`` shows it in its own section.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PLOTS = HERE / "plots"
PAGE = HERE / "RESULTS.md"

# name -> command (run from the repository root). Small settings: the page shows the latest numbers
# of a quick run, not a careful sweep (run the scripts with their defaults for that).
BENCHMARKS = {
    "collectives": [sys.executable, "benchmarks/collectives.py", "--ranks", "2", "4",
                    "--max-bytes", "16777216", "--rounds", "3"],
    "train_step_2": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "benchmarks/train_step.py", "--steps", "10"],
    "train_step_4": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                     "benchmarks/train_step.py", "--steps", "10"],
    "device_step": [sys.executable, "benchmarks/device_step.py", "--steps", "5", "--skip-compile"],
    "compile_step": [sys.executable, "benchmarks/compile_step.py", "--rounds", "8",
                     "--dtypes", "float32,bfloat16", "--variants", "eager,tpu,inductor"],
    "kernel_overhead": [sys.executable, "benchmarks/kernel_overhead.py", "--rounds", "15"],
    "decode": [sys.executable, "benchmarks/decode.py", "--new-tokens", "16", "64", "--hf"],
}
TIMEOUT_S = 1800


# -- parsing what the benchmarks print -------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", text)]


def parse_collectives(out: str) -> dict:
    rows, targets = [], []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 11 and cells[0].isdigit():
            n, op, nbytes, tm, tp, gm, gp, rm, rp, bus, gbus = cells
            rows.append({"ranks": int(n), "op": op, "bytes": int(nbytes), "tpu_median_us": float(tm),
                         "tpu_p90_us": float(tp), "gloo_median_us": float(gm), "gloo_p90_us": float(gp),
                         "ratio_median": float(rm), "ratio_p90": float(rp), "tpu_busbw_gbs": float(bus),
                         "gloo_busbw_gbs": float(gbus)})
        elif len(cells) == 9 and cells[1].isdigit() and cells[7] in ("PASS", "FAIL"):
            targets.append({"target": cells[0], "ranks": int(cells[1]), "ratio_median": float(cells[4]),
                            "ratio_p90": float(cells[5]), "bar": cells[6], "verdict": cells[7]})
    python = re.search(r"our Python per call[^:]*: (\d+) us", out)
    return {"rows": rows, "targets": targets, "python_per_call_us": int(python.group(1)) if python else None}


def parse_train_step(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("{") and "median_step_ms" in line]
    return json.loads(lines[-1]) if lines else {}


def parse_device_step(out: str) -> dict:
    result: dict = {}
    for line in out.splitlines():
        if line.startswith("model "):
            result["model"] = line[len("model "):]
        elif line.startswith("median step ms:"):
            result["median_step_ms"] = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)", line.split(":", 1)[1])}
        elif line.startswith("fused: "):
            ops, syncs, key_us, share = _floats(line)[:4]
            result["fused"] = {"ops_per_step": ops, "syncs_per_step": syncs, "graph_key_us": key_us,
                               "graph_key_share_pct": share}
        elif line.startswith("new programs/kernels"):
            programs, kernels = _floats(line)[:2]
            result["compiled_while_timed"] = {"programs": int(programs), "kernels": int(kernels)}
        elif line.startswith("first two steps"):
            result["first_two_steps_s"] = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)s", line)}
        elif line.startswith("per-op"):
            result["per_op_us"] = {k: float(v) for k, v in re.findall(r"(\w+) (-?[\d.]+)", line.split(":", 1)[1])}
    return result


def parse_compile_step(out: str) -> dict:
    sections, current = [], None
    for line in out.splitlines():
        ratio_line = re.match(r"^([\w-]+) / inductor step: ([\d.]+)x", line)
        if ratio_line and sections:  # printed after its section's tables
            sections[-1].setdefault("vs_inductor", {})[ratio_line.group(1)] = float(ratio_line.group(2))
            continue
        head = re.match(r"^(\S.*?): variant", line)
        if head:  # a table of step times; other tables ("where the step goes") are not parsed
            current = {"title": head.group(1), "variants": []} if "step ms" in line else None
            if current is not None:
                sections.append(current)
            continue
        cells = line.split()
        if current is not None and len(cells) == 5 and re.match(r"^[a-z][\w-]*$", cells[0]):
            name, step_ms, ratio, first_s, loss = cells
            current["variants"].append({"variant": name, "step_ms": float(step_ms),
                                        "x_eager": None if ratio == "-" else float(ratio),
                                        "first_step_s": float(first_s), "loss": float(loss)})
    return {"sections": sections}


def parse_kernel_overhead(out: str) -> dict:
    modes = {}
    for line in out.splitlines():
        match = re.match(r"^\s+(bare jit|kernel\+grad|kernel|torch eager)\s+best\s+([\d.]+) us.*median\s+([\d.]+) us", line)
        if match:
            modes[match.group(1)] = {"best_us": float(match.group(2)), "median_us": float(match.group(3))}
    head = out.splitlines()[0] if out else ""
    return {"what": head.split(",")[0] if head.startswith("RMSNorm") else "", "modes": modes}


def parse_decode(out: str) -> dict:
    """Tables of decode.py: one per model and number of new tokens, a row per mode."""
    tables, current = [], None
    for line in out.splitlines():
        head = re.match(r"^(project model|HF Llama).*?(\d+) new tokens", line)
        if head:
            cache = "dynamic" if "dynamic cache" in line else "static"
            current = {"model": "project (static KV cache)" if head.group(1) == "project model" else
                       f"HF Llama generate ({cache} cache)", "new_tokens": int(head.group(2)), "modes": []}
            tables.append(current)
            continue
        cells = line.split()
        if current is None or not cells or cells[0] not in ("cpu", "strict", "fused"):
            continue
        if len(cells) == 7:  # mode, first ms, first comp, warm ms, x cpu, warm comp, equal
            first_ms, first_comp, warm_ms, ratio, warm_comp = cells[1:6]
            current["modes"].append({"mode": cells[0], "first_ms": float(first_ms), "first_comp": float(first_comp),
                                     "warm_ms": float(warm_ms), "x_cpu": float(ratio.rstrip("x")),
                                     "warm_comp": float(warm_comp), "tokens_equal": cells[6] == "True"})
        else:
            nums = _floats(line)  # first ms, first comp, warm ms, x cpu, warm comp
            if len(nums) >= 5:
                current["modes"].append({"mode": cells[0], "first_ms": nums[0], "first_comp": nums[1],
                                         "warm_ms": nums[2], "x_cpu": nums[3], "warm_comp": nums[4],
                                         "tokens_equal": line.rstrip().endswith("True")})
    return {"tables": tables}


PARSERS = {"collectives": parse_collectives, "train_step_2": parse_train_step, "train_step_4": parse_train_step,
           "device_step": parse_device_step, "compile_step": parse_compile_step,
           "kernel_overhead": parse_kernel_overhead, "decode": parse_decode}


# -- running -----------------------------------------------------------------------------------------
def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for module in ("torch", "jax", "jaxlib"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = None
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "system": platform.platform(),
            "python": platform.python_version(), **versions}


def store(name: str, output: str, command: list[str] | str, started: str, seconds: float, code: int) -> Path:
    RESULTS.mkdir(exist_ok=True)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    record = {"name": name, "command": command if isinstance(command, str) else " ".join(
                  ["python" if c == sys.executable else c for c in command]),
              "started_utc": started, "seconds": round(seconds, 1), "exit_code": code,
              "load_average_after": load, "machine": machine(), "parsed": PARSERS[name](output),
              "output": output}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def run(names: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in names:
        command = BENCHMARKS[name]
        started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        print(f"{name}: {' '.join(command)}", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        path = store(name, proc.stdout, command, started, time.monotonic() - t0, proc.returncode)
        print(f"  exit {proc.returncode}, {time.monotonic() - t0:.0f} s -> {path.relative_to(ROOT)}", flush=True)


# -- rendering ---------------------------------------------------------------------------------------
def _load() -> dict:
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(RESULTS.glob("*.json"))}


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _provenance(record: dict) -> str:
    load = record.get("load_average_after")
    load_text = f", load average {load:.1f} after the run" if load is not None else ""
    return (f"_Run {record['started_utc']} ({record['seconds']:.0f} s{load_text}):_ "
            f"`{record['command']}`")


def plot_collectives(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["parsed"]["rows"]
    ranks = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(1, len(ranks), figsize=(6 * len(ranks), 4), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], ranks):
        for op in sorted({r["op"] for r in rows if r["ranks"] == n}):
            points = sorted((r["bytes"], r["ratio_median"]) for r in rows if r["ranks"] == n and r["op"] == op)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=op)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(title=f"{n} ranks: tpu time / gloo time (median)", xlabel="message size (bytes)",
               ylabel="ratio (< 1: tpu faster)")
        ax.legend(fontsize=8)
    fig.suptitle("CPU emulation: every collective as an XLA program vs torch's gloo (noisy shared machine)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_steps(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    device = results.get("device_step", {}).get("parsed", {}).get("median_step_ms")
    if device:
        panels.append(("device eager modes (1 process)", {"CPU eager" if k == "cpu" else k: v
                                                            for k, v in device.items()}))
    for section in results.get("compile_step", {}).get("parsed", {}).get("sections", []):
        panels.append((f"torch.compile, {section['title']}",
                       {("backend=tpu" if v["variant"] == "tpu" else v["variant"]): v["step_ms"]
                        for v in section["variants"]}))
    fsdp = {}
    for name in ("train_step_2", "train_step_4"):
        parsed = results.get(name, {}).get("parsed", {})
        if parsed:
            for backend, ms in parsed["median_step_ms"].items():
                fsdp[f"{parsed['world_size']} ranks {backend}"] = ms
    if fsdp:
        panels.append(("FSDP2 step, tpu vs gloo backend", fsdp))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (title, values) in zip(axes[0], panels):
        ax.bar(range(len(values)), list(values.values()), color="tab:blue")
        ax.set_xticks(range(len(values)), list(values), rotation=30, ha="right", fontsize=8)
        ax.set(title=title, ylabel="median step (ms)")
        ax.title.set_fontsize(9)
    fig.suptitle("Training step time per mode (small Llama-style model; noisy shared 2-core machine)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render() -> None:
    results = _load()
    PLOTS.mkdir(exist_ok=True)
    out = ["# Benchmark results", "",
           "Generated by `python benchmarks/report.py render` from `benchmarks/results/*.json` (written by "
           "`python benchmarks/report.py run`); do not edit by hand.", ""]
    tpu = results.pop("tpu_step", None)
    if tpu:
        out += render_tpu(tpu)
    any_record = next(iter(results.values()), None)
    if any_record:
        m = any_record["machine"]
        out += [f"**Machine**: {m['cores']} vCPUs ({m['cpu']}), {m['system']}; Python {m['python']}, torch "
                f"{m['torch']}, jax {m['jax']}. Every number below"
                + (" (all but the TPU section above)" if tpu else "") + " is a CPU emulation: processes play TPU "
                "chips and JAX's CPU backend computes, so they show tpudist's own overheads, not TPU speed.", "",
                "**Noise**: the machine is a 2-vCPU VM shared with other jobs (several engineers' test suites "
                "ran during these runs). Each benchmark interleaves the variants it compares round by round, "
                "so noise hits them alike and the *ratios* are the meaningful part; absolute times moved by "
                "2x or more between runs. Rerun on your machine before relying on a number.", ""]
    coll = results.get("collectives")
    if coll:
        parsed = coll["parsed"]
        out += ["## Collectives: tpu vs gloo", "", _provenance(coll), "",
                "Each op timed call by call on the \"tpu\" backend and on torch's gloo, in alternating rounds in "
                "the same rank processes. Ratio = tpu time / gloo time (< 1: tpu faster). Bus bandwidth as "
                "nccl-tests defines it.", "",
                "![tpu/gloo time ratio per collective and message size](plots/collectives_ratio.png)", "",
                "| ranks | op | size | tpu median us | gloo median us | tpu/gloo median | tpu/gloo p90 | "
                "tpu busbw GB/s | gloo busbw GB/s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in parsed["rows"]:
            out.append(f"| {r['ranks']} | {r['op']} | {_size(r['bytes'])} | {r['tpu_median_us']:.0f} | "
                       f"{r['gloo_median_us']:.0f} | {r['ratio_median']:.2f} | {r['ratio_p90']:.2f} | "
                       f"{r['tpu_busbw_gbs']:.3f} | {r['gloo_busbw_gbs']:.3f} |")
        out.append("")
        if parsed.get("python_per_call_us") is not None:
            out += [f"tpudist's own Python per call (a 4-byte `dist.all_reduce` in a 1-rank world, beyond its XLA "
                    f"program): {parsed['python_per_call_us']} us.", ""]
        plot_collectives(coll, PLOTS / "collectives_ratio.png")
    fsdp = [results[n] for n in ("train_step_2", "train_step_4") if n in results]
    if fsdp:
        out += ["## FSDP2 training step: tpu vs gloo", "",
                "`benchmarks/train_step.py`: two identical FSDP2 models (Llama-style, dim 64, 2 layers, seq 32, "
                "global batch 16), one sharded over the \"tpu\" world, one over a gloo group of the same ranks; "
                "steps alternate between them after an untimed warm-up.", "",
                "| ranks | tpu median ms | gloo median ms | tpu/gloo median | tpu/gloo p90 | first step tpu / gloo ms | "
                "programs built while timed | command |", "|---|---|---|---|---|---|---|---|"]
        for rec in fsdp:
            p = rec["parsed"]
            out.append(f"| {p['world_size']} | {p['median_step_ms']['tpu']} | {p['median_step_ms']['gloo']} | "
                       f"{p['tpu_over_gloo']} | {p['tpu_over_gloo_p90']} | {p['first_step_ms']['tpu']} / "
                       f"{p['first_step_ms']['gloo']} | {p['programs_built_while_timed']} | `{rec['command']}` "
                       f"({rec['started_utc']}) |")
        out.append("")
    dev = results.get("device_step")
    if dev:
        p = dev["parsed"]
        med = p.get("median_step_ms", {})
        out += ["## Eager modes of the device", "", _provenance(dev), "",
                f"`benchmarks/device_step.py`: one process holds four copies of a Llama-style model ({p.get('model', '')}); "
                "each round runs one training step (forward, backward, AdamW, `loss.item()`) of each, in rotating "
                "order. CPU eager is torch's own CPU kernels with one thread.", "",
                "| | CPU eager | Debug | Strict | Fused |", "|---|---|---|---|---|",
                "| median step ms | " + " | ".join(f"{med.get(k, float('nan')):.1f}" for k in ("cpu", "debug", "strict", "fused")) + " |",
                "| x CPU eager | 1.00 | " + " | ".join(f"{med[k] / med['cpu']:.2f}" for k in ("debug", "strict", "fused")) + " |",
                ""]
        if "first_two_steps_s" in p:
            out += ["First two steps (compiles): " + ", ".join(f"{k} {v:.2f} s" for k, v in p["first_two_steps_s"].items())
                    + ". Compiled during the timed rounds: " + ", ".join(
                        f"{v} {k}" for k, v in p.get("compiled_while_timed", {}).items()) + ".", ""]
        if med.get("fused"):
            out += [f"Fused runs a step {med['strict'] / med['fused']:.2f}x as fast as Strict and "
                    f"{med['debug'] / med['fused']:.2f}x as fast as Debug.", ""]
        if "fused" in p:
            f = p["fused"]
            out += [f"Fused: {f['ops_per_step']:.0f} ops per step, {f['syncs_per_step']:.1f} syncs per step, graph key "
                    f"{f['graph_key_us']:.0f} us per sync ({f['graph_key_share_pct']:.2f}% of a step).", ""]
        if "per_op_us" in p:
            out += ["Per op (a 64x64 add, us): " + ", ".join(f"{k} {v:.1f}" for k, v in p["per_op_us"].items()), ""]
    comp = results.get("compile_step")
    if comp:
        out += ["## torch.compile", "", _provenance(comp), "",
                "`benchmarks/compile_step.py`: the recipe's model (dim 64, 2 layers, seq 32, batch 16), forward + "
                "cross-entropy + backward compiled (or eager) + eager AdamW, variants interleaved step by step.", "",
                "| dtype / device | variant | median step ms | x eager | first step s |", "|---|---|---|---|---|"]
        for s in comp["parsed"]["sections"]:
            for v in s["variants"]:
                ratio = "" if v["x_eager"] is None else f"{v['x_eager']:.2f}"
                out.append(f"| {s['title']} | {v['variant']} | {v['step_ms']:.2f} | {ratio} | {v['first_step_s']:.2f} |")
        out.append("")
        for s in comp["parsed"]["sections"]:
            if s.get("vs_inductor"):  # issue #28's target: within 1.1x of inductor's step
                out += [f"{s['title']}: " + ", ".join(f"{name} is {r:.2f}x inductor's step"
                                                      for name, r in s["vs_inductor"].items()) + " (target 1.1x).", ""]
    kern = results.get("kernel_overhead")
    if kern:
        modes = kern["parsed"]["modes"]
        out += ["## Kernels", "", _provenance(kern), "",
                f"`benchmarks/kernel_overhead.py`: {kern['parsed']['what'] or 'RMSNorm on CPU tensors'}, modes interleaved "
                "round by round; the best round is the least disturbed by other processes.", "",
                "| mode | best round us/call | median us/call | best vs bare jit |", "|---|---|---|---|"]
        bare = modes.get("bare jit", {}).get("best_us")
        for name, v in modes.items():
            rel = f"{v['best_us'] / bare:.2f}x" if bare else ""
            out.append(f"| {name} | {v['best_us']:.1f} | {v['median_us']:.1f} | {rel} |")
        out.append("")
    dec = results.get("decode")
    if dec:
        out += ["## Decoding", "", _provenance(dec), "",
                "`benchmarks/decode.py`: greedy decoding, modes interleaved call by call. ms/token is the median "
                "decode step (project model) or the whole `generate` call per token (HF); compiles are programs "
                "plus kernels per token, prefill excluded; the first call compiles, later calls should not.", "",
                "| model | new tokens | mode | first call ms/token | compiles/token | warm ms/token | x CPU eager "
                "| warm compiles/token | tokens = CPU |", "|---|---|---|---|---|---|---|---|---|"]
        for t in dec["parsed"]["tables"]:
            for m in t["modes"]:
                out.append(f"| {t['model']} | {t['new_tokens']} | {m['mode']} | {m['first_ms']:.2f} | "
                           f"{m['first_comp']:.2f} | {m['warm_ms']:.2f} | {m['x_cpu']:.2f} | {m['warm_comp']:.2f} | "
                           f"{m['tokens_equal']} |")
        out.append("")
    if any(k in results for k in ("device_step", "compile_step", "train_step_2")):
        plot_steps(results, PLOTS / "step_times.png")
        out += ["## Step time per mode", "", "![median step time per mode](plots/step_times.png)", ""]
    out += ["## Earlier measurements", "",
            "Measurements from the project's development (other settings, other load), kept as reference; "
            "see [docs/design.md](../docs/design.md) for what they decided.", "", EARLIER]
    PAGE.write_text("\n".join(out).rstrip() + "\n", encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)} and {PLOTS.relative_to(ROOT)}/*.png")


_TPU_MODES = {"twin_splash": "JAX twin, splash attention", "twin_flash": "JAX twin, tpudist's flash kernel",
              "twin_xla": "JAX twin, XLA attention",
              "twin": "old JAX twin (before issue #57: XLA attention, pair RoPE, 8 kv heads)",
              "compiled": "compiled", "compiled_shaped": "compiled, N-d storages",
              "layers": "compiled per layer", "fused": "Fused", "fused_shaped": "Fused, N-d storages",
              "hf": "HF Llama (Fused)", "strict": "Strict"}


def _tpu_modes(parsed: dict) -> list:
    """(name, result) of each mode in the benchmark's order, those kept from an earlier run among them."""
    order = list(_TPU_MODES)
    return sorted(parsed["modes"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))


def render_tpu(record: dict) -> list[str]:
    """The section of ``tpu_step.json``, written on the chip by ``benchmarks/tpu_step.py --json``."""
    p, m = record["parsed"], record["machine"]
    c = p["config"]
    kind = m.get("device_kind") or "?"
    out = [f"## On the chip: {kind} ({record['started_utc'][:10]})", "",
           f"_Run {record['started_utc']} ({record['seconds']:.0f} s"
           + ("" if record.get("complete", True) else ", stopped before the end: partial") + f"):_ "
           f"`{record['command']}`; platform {m.get('platform')}, jax {m.get('jax')}, torch {m.get('torch')}.", "",
           f"`benchmarks/tpu_step.py`: the recipe's Transformer (dim {c['dim']}, {c['layers']} layers, {c['heads']} "
           f"heads, {c['kv_heads']} kv heads, vocab {c['vocab']}, {c['params'] / 1e6:.1f}M parameters, {c['dtype']}), "
           f"seq {c['seq']}, batch {c['batch']}, AdamW; one mode after another from the same weights and batches, "
           f"caches {c['cache']}. A JAX twin is the same model written in plain JAX (one jitted step). "
           f"FLOPs/step {p['flops_per_step'] / 1e12:.2f} T = `{p['flops_formula']}`; MFU against "
           f"{p['peak_flops'] / 1e12:.0f} TFLOP/s.", "",
           "| mode | step 1 s | step 2 s | XLA compiles step 1 / 2 / timed | median step ms | tokens/s | TFLOP/s "
           "| MFU | unsynced step ms (MFU) | device busy ms/step | programs/step | step-1 loss |", "|---" * 12 + "|"]
    notes = []
    for name, mode in _tpu_modes(p):
        label = _TPU_MODES.get(name, name)
        if mode.get("settings"):
            label += " with " + ", ".join(f"`{k}={v}`" for k, v in mode["settings"].items())
        if mode.get("status") != "ok":
            notes.append(f"- {label}: {mode.get('status')}: {mode.get('why') or mode.get('error', '')}")
            continue
        dev = (mode.get("profile") or {}).get("device") or {}
        compiles = " / ".join(str(mode[k]["compiles"]["xla_compiles"]) for k in ("step1", "step2")) \
            + f" / {mode['steady_compiles']['xla_compiles']}"
        busy = f"{dev['busy_s_per_step'] * 1e3:.1f}" if dev else "-"
        progs = f"{dev['programs_per_step']:.1f}" if dev else "-"
        un = mode.get("unsynced")
        unsynced = f"{un['step_s'] * 1e3:.1f} ({un['mfu'] * 100:.1f}%)" if un else "-"
        out.append(f"| {label} | {mode['step1']['s']:.1f} | {mode['step2']['s']:.1f} | {compiles} | "
                   f"{mode['median_step_s'] * 1e3:.1f} | {mode['tokens_per_s']:,.0f} | {mode['model_tflops']:.1f} | "
                   f"{mode['mfu'] * 100:.1f}% | {unsynced} | {busy} | {progs} | {mode['step1']['loss']:.5f} |")
    out += [""] + notes + ([""] if notes else [])
    added = p.get("added_from") or {}
    by_run: dict = {}  # the run that measured each kept mode (older JSONs name only the file they came from)
    for k in added.get("modes", []):
        run = p["modes"].get(k, {}).get("run") or added
        by_run.setdefault((run.get("started_utc"), run.get("command")), []).append(k)
    for (started, command), kept in by_run.items():
        when = f"the run of {started}" if started else f"`{added['path']}`"
        out += [f"Kept from {when}" + (f" (`{command}`)" if command else "") + ": "
                + ", ".join(_TPU_MODES.get(k, k) for k in kept)
                + "; the ratios below compare modes of different runs (and of the code each ran).", ""]
    if p.get("first_loss_rel_diff_vs_twin"):
        out += ["Step-1 loss against the twin's (same weights and batch; bf16 rounding apart they are one model): "
                + ", ".join(f"{_TPU_MODES.get(k, k)} {v:.1e}" for k, v in p["first_loss_rel_diff_vs_twin"].items())
                + " relative.", ""]
    twin = p.get("anchor", "twin" if "twin" in p["modes"] else None)  # JSONs before issue #57 name none
    if twin:
        out += [f"The ratios' twin (the anchor): {_TPU_MODES.get(twin, twin)}"
                + (". It is the twin of before issue #57, which a JAX expert would not write (XLA's full "
                   "seq x seq attention, RoPE on a padded size-2 axis): ratios to it flatter the torch modes; "
                   "`benchmarks/jax_twin.py` now writes the model as an expert would."
                   if twin == "twin" else ", the fastest twin of the run.") + (
                    f" The twin was kept from the run of {p['modes'][twin]['run']['started_utc']}."
                    if p["modes"].get(twin, {}).get("run") else ""), ""]
    if p.get("ratios"):
        out += ["Ratios: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in p["ratios"].items()) + ".", ""]
    if p.get("targets"):
        out += [f"| target (issue #37; twin: {_TPU_MODES.get(twin, twin)}) | value | bar | |", "|---|---|---|---|"]
        for t in p["targets"]:
            value = "-" if t["value"] is None else f"{t['value']:.2f}"
            out.append(f"| {t['what']} | {value} | {t['op']} {t['bar']} | {t['status']} |")
        out.append("")
    rows = []
    for name, mode in _tpu_modes(p):
        prof = mode.get("profile") or {}
        if mode.get("status") != "ok" or not prof.get("categories"):
            continue
        cats = ", ".join(f"{k} {v['share'] * 100:.0f}%" for k, v in prof["categories"].items() if v["share"] >= 0.005)
        top = "; ".join(f"{o['category']} {o['shape'] or o['name'][:30]}"
                        + (f" (`{o['what'][-60:]}`)" if o.get("what") else "") + f" {o['s_per_step'] * 1e3:.1f} ms"
                        for o in prof["top_ops"][:3])
        how = (f"fusions read from the HLO of {prof['hlo_modules']} programs" if prof.get("hlo_modules")
               else "matmuls by op name only: those fused into a `fusion.N` count as other")
        rows.append(f"- {_TPU_MODES.get(name, name)}: op time {prof['ops_s_per_step'] * 1e3:.1f} ms/step "
                    f"({cats}; {how}); "
                    f"largest: {top}.")
    if rows:
        out += ["Where the device time goes (JAX profiler, `benchmarks/xla_profile.py`; shares of op time):", ""]
        out += rows + [""]
    builds = [f"- {_TPU_MODES.get(name, name)}: {mode['step1']['slowest_fused_builds']}."
              for name, mode in _tpu_modes(p) if mode.get("status") == "ok" and mode["step1"].get("slowest_fused_builds")]
    if builds:
        out += ["Step 1's slowest Fused programs to build (trace, XLA compile; the ops each runs, most common first):",
                ""] + builds + [""]
    return out


EARLIER = """\
- **Collectives, full sweep to 64 MiB, quiet machine, 2026-11-29** (plot:
  [docs/collectives_ratio.png](../docs/collectives_ratio.png)): at >= 1 MiB reduce_scatter took
  0.29-0.88x gloo's time, all_gather 0.42-0.94x (1.58x at 1 MiB on 4 ranks), all_reduce 0.76-1.35x,
  all_to_all 1.30-2.44x, broadcast 1.48-3.65x. At 4 B all_reduce was 2.3-4.2x gloo. Between, where a
  collective fits the envelope, reductions beat gloo (0.39-0.66x at 4-64 KiB).
- **What a small collective costs** (bare XLA programs, 2 ranks): a 4-byte psum 290-340 us, the
  envelope's rows all_to_all 360-390 us, gloo's 4-byte all_reduce 340-410 us; on 4 ranks 735-820,
  1910 and 790-820 us. Per-call times are bimodal (~0.5 ms or ~4 ms, a scheduler tick) when ranks'
  threads collide on 2 cores.
- **Host work after a wait** runs slower on this VM: a fixed ~10 us piece of Python took 19-32 us
  right after a blocking call (the vCPU halts while idle and runs cold for tens of microseconds after
  waking). Every collective's host work runs right after such a wait: the remaining gap to gloo for
  small messages is this, paid in Python.
- **Recurring collectives as one program**: 0.82-0.96x the time of the separate exchange + data pair
  in most cases (2 ranks, 128 KB - 1 MiB); FSDP2 step 0.95x (2 ranks), 0.94x (4).
- **gloo loop thread idle**: 0.53-0.91x the time for 128 KB - 1 MiB ops on 2 ranks, 0.80-1.01x on 4.
- **malloc tuning**: a 64 MiB XLA elementwise op 23 -> 6-8 ms; a 64 MiB psum 101 -> 66-80 ms.
- **Overlap** (`benchmarks/overlap.py`, 16 MiB all_reduce, 2 ranks): with host work that needs no CPU,
  an async all_reduce hides 0.85 of it (gloo 0.98); with CPU-bound host work neither backend overlaps
  on 2 cores.
- **`TPUDIST_DEBUG=DETAIL`** adds 150-350 us per call on 2 ranks (1.2-1.5x a 4-byte all_reduce,
  1.03-1.7x at 1 MiB; `benchmarks/debug_overhead.py`).
- **Device eager modes, quiet machine** (dim 64, 2 layers, B2 T64): CPU eager 8.4 ms, Debug 78.6,
  Strict 60.3, Fused 15.7 ms (Fused 3.8x Strict); at dim 128, B4 T128 Fused took 0.73-0.77x CPU
  eager's time. Fused compile of the first two steps in a fresh process: 11.8 s cold, 0.52 s with a
  warm cache.
- **torch.compile, quiet machine**: fp32 step 0.86-1.02x eager (median 0.94x over 7 runs), bf16
  0.60-0.70x; first step 7-9 s (eager 0.03-0.1 s); a second process spent 0.06 s in the backend
  instead of 3.8 s.
- **Kernels** (RMSNorm 8x64): the torch <-> JAX boundary costs ~40 us per call; a 64 MB input costs
  6-10 us more than a `jax.Array` (never copied).
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    commands = parser.add_subparsers(dest="action", required=True)
    run_parser = commands.add_parser("run", help="run benchmarks, store their results, render")
    run_parser.add_argument("names", nargs="*", help=f"some of {', '.join(BENCHMARKS)} (default: all)")
    commands.add_parser("render", help="write RESULTS.md and the plots from benchmarks/results/")
    ingest = commands.add_parser("ingest", help="store the output of a benchmark run made by hand")
    ingest.add_argument("name", choices=list(BENCHMARKS))
    ingest.add_argument("output", type=Path)
    ingest.add_argument("--command", required=True)
    ingest.add_argument("--started", default=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    ingest.add_argument("--seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.action == "run":
        unknown = sorted(set(args.names) - set(BENCHMARKS))
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}: the benchmarks are {', '.join(BENCHMARKS)}")
        run(args.names or list(BENCHMARKS))
    elif args.action == "ingest":
        store(args.name, args.output.read_text(encoding="utf-8"), args.command, args.started, args.seconds, 0)
    render()


if __name__ == "__main__":
    main()
