"""The aten ops with no lowering that PyTorch's OpInfo samples reach on the "tpu" device, with counts.

    PYTHONPATH=. python scripts/opinfo_unlowered.py                    # every OpInfo, on the device
    PYTHONPATH=. python scripts/opinfo_unlowered.py linalg.qr cholesky # a few OpInfos by name
    PYTHONPATH=. python scripts/opinfo_unlowered.py --json out.json    # also the raw outcomes

Runs each OpInfo of op_db (and the foreach ones) as ``tests/device/test_device_opinfo.py`` does with
``TPUDIST_OPS_ALL=1``: the first sample of each of bool, int32, int64, bfloat16 and float32 on tpu
tensors in Strict mode, compared with CPU eager. It prints the pass / unlowered / failing counts, then
each aten op without a lowering with the OpInfos that reach it, most reached first (an OpInfo counts
as unlowered when every sample stops at such an op; one whose other dtypes run is marked ``*``), then
the failing OpInfos with their first message. Installs the device in this process (one PrivateUse1 rename per
process), so run it on its own. Takes about as long as the full device OpInfo test (minutes).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HINT = re.compile(r"lowers\((torch\.ops\.[\w.]+)\)")


def reached_op(detail: str) -> str:
    """The op a device error names as having no lowering (its ``@lowers(...)`` hint), else the message."""
    found = re.search(r"decomposition reached ([\w.]+)", detail) or re.match(r"aten op ([\w.]+) has no JAX", detail)
    if found:
        return found.group(1)
    found = _HINT.search(detail)
    if found:
        return found.group(1).removeprefix("torch.ops.")
    twin = re.match(r"(\S+) writes into its arguments and has no functional twin", detail)
    if twin:
        return f"{twin.group(1)} (no functional twin)"
    return detail[:120]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="OpInfo names to run (default: all)")
    parser.add_argument("--json", help="write every OpInfo's outcomes to this file")
    args = parser.parse_args(argv)

    os.environ["TPUDIST_OPS_ALL"] = "1"
    os.environ.setdefault("TPUDIST_EAGER_MODE", "strict")
    sys.path[:0] = [os.path.join(ROOT, "tests", "ops"), os.path.join(ROOT, "tests", "device")]
    import test_device_opinfo  # noqa: E402  (reads TPUDIST_OPS_ALL at import)

    selection = [s for s in test_device_opinfo.SELECTION if not args.names or s[0] in args.names]
    started = time.perf_counter()
    outcomes = {}
    for i, (name, variant) in enumerate(selection):
        outcomes[(name, variant)] = test_device_opinfo.run_opinfo_on_device(name, variant)
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(selection)} OpInfos ({time.perf_counter() - started:.0f} s)", file=sys.stderr)

    kinds = collections.Counter()
    by_op = collections.defaultdict(list)
    failing = {}
    for (name, variant), per_dtype in outcomes.items():
        label = f"{name}.{variant}" if variant else name
        statuses = {s for _, s, _ in per_dtype}
        if statuses & {"mismatch", "error"}:
            kinds["fail"] += 1
            failing[label] = next(f"{d}: {s}: {detail}" for d, s, detail in per_dtype if s in ("mismatch", "error"))
        elif per_dtype and statuses == {"unsupported"}:
            kinds["unlowered"] += 1
        else:
            kinds["pass"] += 1
        partly = "unsupported" in statuses and statuses != {"unsupported"}
        for op in sorted({reached_op(detail) for _, s, detail in per_dtype if s == "unsupported"}):
            by_op[op].append(label + ("*" if partly else ""))
    print(f"{len(outcomes)} OpInfos in {time.perf_counter() - started:.0f} s: {kinds['pass']} pass, "
          f"{kinds['unlowered']} reach an op with no lowering, {kinds['fail']} fail")
    print("\nunlowered op (OpInfos that reach it; * where other dtypes of that OpInfo run): OpInfos")
    for op, labels in sorted(by_op.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"  {op} ({len(labels)}): {' '.join(labels)}")
    if failing:
        print("\nfailing:")
        for label, why in failing.items():
            print(f"  {label}: {why[:300]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({".".join(filter(None, key)): per_dtype for key, per_dtype in outcomes.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
