"""Every ```python block of README.md and docs/*.md runs, so the docs cannot rot.

How a block runs is said by its first line:
- ``# fragment`` (optionally ``# fragment: why``): not run (a piece of a larger program, or a sketch that needs a TPU VM). Counted:
  ``EXPECTED_FRAGMENTS`` pins how many there are, so a block is never skipped silently.
- ``# run: torchrun N`` (optionally ``session=NAME``): under torchrun with N emulated chips, through
  ``tpudist.testing.torchrun_command``. Blocks of one file with the same session are one program:
  they are joined in order (a guide that builds on its previous block) and run once.
- ``# run: pytest``: the block is a test file; pytest runs it in a subprocess.
- ``# run: python``: in a fresh Python process of its own (e.g. it must import before anything else).
- anything else: all such blocks of all files in one Python process, one after the other, each in a
  fresh namespace (sharing the process saves the import of torch and JAX per block). The process
  installs the "tpu" device first, as a program using it must before its first backward.
Identical programs (the same block in README.md and in a guide) run once, and all torchrun programs
of one size share one torchrun launch (each program starts and destroys its own "tpu" world, as
the guides show; programs that install the "tpu" device go first, since the device must be
installed before the process's first backward). Every command has a hard timeout and its whole
session is killed by PID.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import sys

import pytest

from tpudist.testing import run_command, torchrun_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXPECTED_FRAGMENTS = 4  # change deliberately when a guide gains or loses a fragment
TIMEOUT_S = 300.0

_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
_FENCED = re.compile(r"^```.*?^```", re.M | re.S)  # any fenced block (links inside are code)
_RUN = re.compile(r"#\s*run:\s*(torchrun\s+(\d+)(?:\s+session=(\S+))?|pytest|python)\s*$")

# Runs a file's shared blocks in this process, one after the other, each in a fresh namespace.
_SHARED_RUNNER = """
import json, linecache, sys, traceback
import tpudist.device  # noqa: F401  (before any backward in this process)
blocks = json.load(open(sys.argv[1]))
for name, code in blocks:
    print(f"=== {name}", flush=True)
    # the block's source, for inspect.getsource (Helion parses its kernels' source) as in a user's file
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        print(f"=== FAILED {name}", flush=True)
        sys.exit(1)
print("=== all passed", flush=True)
"""

# The same for torchrun programs: every rank runs the programs in order; a failing rank exits at
# once (its peers then fail or time out in their next collective).
_TORCHRUN_RUNNER = """
import json, linecache, os, sys, traceback
blocks = json.load(open(sys.argv[1]))
rank = os.environ.get("RANK")
for name, code in blocks:
    print(f"=== rank {rank}: {name}", flush=True)
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # for inspect.getsource
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        print(f"=== rank {rank}: FAILED {name}", flush=True)
        sys.stdout.flush()
        os._exit(1)
print(f"=== rank {rank}: all passed", flush=True)
"""


def _blocks() -> list[tuple[str, int, str]]:
    """(file, line, code) of every ```python block."""
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            out.append((str(path.relative_to(ROOT)), line, match.group(1)))
    return out


def _kind(code: str) -> tuple[str, int, str | None]:
    """("fragment" | "torchrun" | "pytest" | "python" | "shared", ranks, session)."""
    first = code.lstrip("\n").split("\n", 1)[0].strip()
    if first == "# fragment" or first.startswith("# fragment:"):
        return "fragment", 0, None
    match = _RUN.match(first)
    if not match:
        if first.startswith("# run"):
            raise ValueError(f"unknown run marker {first!r}: use '# run: torchrun N [session=NAME]', "
                             "'# run: pytest', '# run: python' or '# fragment'")
        return "shared", 0, None
    if match.group(2):
        return "torchrun", int(match.group(2)), match.group(3)
    return match.group(1), 0, None


def _programs() -> tuple[list, list, int]:
    """(shared: [(file, [(name, code)])], own: [(id, kind, ranks, code)], fragments)."""
    shared: dict[str, list] = {}
    own: dict[str, tuple] = {}
    sessions: dict[tuple, list] = {}
    fragments = 0
    for file, line, code in _blocks():
        kind, ranks, session = _kind(code)
        name = f"{file}:{line}"
        if kind == "fragment":
            fragments += 1
        elif kind == "shared":
            shared.setdefault(file, []).append((name, code))
        elif session:
            sessions.setdefault((file, ranks, session), []).append((name, code))
        else:
            own.setdefault(hashlib.sha1(f"{kind}{ranks}{code}".encode()).hexdigest(), (name, kind, ranks, code))
    for (file, ranks, session), parts in sessions.items():
        code = "\n".join(f"# --- {name}\n{c}" for name, c in parts)
        own[f"{file}:{session}"] = (f"{file}:session={session}", "torchrun", ranks, code)
    launches: dict[int, list] = {}
    others = []
    for name, kind, ranks, code in own.values():
        if kind == "torchrun":
            launches.setdefault(ranks, []).append((name, code))
        else:
            others.append((name, kind, ranks, code))
    for ranks, programs in launches.items():
        programs.sort(key=lambda p: ("import tpudist.device" not in p[1], p[0]))
        others.append((f"torchrun {ranks}: " + ", ".join(n for n, _ in programs), "torchrun", ranks,
                       json.dumps(programs)))
    return sorted(shared.items()), sorted(others), fragments


SHARED, OWN, FRAGMENTS = _programs()


def _env() -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _check(code: int, out: str, what: str) -> None:
    assert code == 0, f"{what} failed (exit {code}):\n{out[-6000:]}"


def test_examples_in_one_process(tmp_path):
    blocks = [block for _, file_blocks in SHARED for block in file_blocks]
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(blocks))
    runner = tmp_path / "runner.py"
    runner.write_text(_SHARED_RUNNER)
    code, out = run_command([sys.executable, str(runner), str(spec)], timeout=TIMEOUT_S, env=_env(),
                            cwd=tmp_path)
    _check(code, out, f"the single-process examples ({len(blocks)} blocks)")
    assert "=== all passed" in out


@pytest.mark.parametrize("name,kind,ranks,code", OWN, ids=[o[0].split(":")[0] if o[1] == "torchrun" else o[0]
                                                          for o in OWN])
def test_example_in_its_own_processes(name, kind, ranks, code, tmp_path):
    script = tmp_path / ("test_example.py" if kind == "pytest" else "example.py")
    script.write_text(code)
    if kind == "torchrun":  # code: the JSON list of (name, program) of one launch
        runner = tmp_path / "runner.py"
        runner.write_text(_TORCHRUN_RUNNER)
        command = torchrun_command(ranks, str(runner), str(script))
    elif kind == "pytest":
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(script)]
    else:
        command = [sys.executable, str(script)]
    out_code, out = run_command(command, timeout=TIMEOUT_S, env=_env(), cwd=tmp_path)
    _check(out_code, out, f"the example at {name}")


def test_every_block_is_run_or_marked():
    """A block that is not run must say so (# fragment), and the count of those is pinned."""
    run = sum(len(b) for _, b in SHARED) + sum(
        len(json.loads(code)) if kind == "torchrun" else 1 for _, kind, _, code in OWN)
    print(f"docs examples: {len(_blocks())} python blocks; {run} programs run, {FRAGMENTS} fragments")
    assert FRAGMENTS == EXPECTED_FRAGMENTS, (
        f"{FRAGMENTS} python blocks are marked '# fragment', EXPECTED_FRAGMENTS={EXPECTED_FRAGMENTS}: "
        "make the new block runnable, or change the count on purpose")
    assert run >= 2 * FRAGMENTS, f"only {run} runnable examples for {FRAGMENTS} fragments: the docs drift"


if __name__ == "__main__":  # list how each block runs
    for name, blocks in SHARED:
        print(name, "shared:", [n for n, _ in blocks])
    for item in OWN:
        print(item[0], item[1], item[2])
    print("fragments:", FRAGMENTS)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_relative_links_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists (and a heading in it)."""
    broken = []
    for path in DOCS:
        text = _FENCED.sub("", path.read_text(encoding="utf-8"))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", _FENCED.sub("", resolved.read_text(encoding="utf-8")), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
