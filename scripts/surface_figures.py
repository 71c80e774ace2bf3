"""Issue 48's figures of the buffer's surfaces, for a commit or the work tree.

    .venv/bin/python scripts/surface_figures.py [REV]

* methods written by hand per surface: the public ``def`` / ``async def`` in the class body of
  ``AsyncReplayBuffer``, the Ray ``BufferActor``, ``BufferClient`` and ``MemoryReplayBuffer`` (methods made
  from the operation table are not in the body);
* operations not offered: before the table, the differences ``tests/core/test_surfaces.py`` declared
  "not offered yet"; with the table, its offers that are ``absent`` per surface (each with its reason);
* operations the conformance suite drives: the buffer's operations named on a handle (``buf.NAME``) in the
  conformance modules (the state machine and, with the table, the per-operation scenarios).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

MEMORY = ("kvckpt/testing/fixtures/memory_buffer.py", "kvckpt/testing/memory_buffer.py")
CONFORMANCE = ("kvckpt/testing/conformance/buffer.py", "kvckpt/testing/conformance/scenarios.py",
               "kvckpt/testing/buffer_conformance.py", "kvckpt/testing/buffer_scenarios.py")


def read(rev: str | None, path: str) -> str | None:
    """The file at ``rev`` (the work tree if None), or None if it is not there."""
    if rev is None:
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            return None
    done = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def hand_written(source: str, cls: str) -> int:
    """Public methods defined in the body of class ``cls``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")
                       for n in node.body)
    raise SystemExit(f"no class {cls}")


def main(rev: str | None) -> None:
    memory = next(text for path in MEMORY if (text := read(rev, path)) is not None)
    counts = [hand_written(read(rev, "kvckpt/buffer/aio.py") or "", "AsyncReplayBuffer"),
              hand_written(read(rev, "integrations/ray/actor.py") or "", "BufferActor"),
              hand_written(read(rev, "integrations/ray/client.py") or "", "BufferClient"),
              hand_written(memory, "MemoryReplayBuffer")]
    print("methods written by hand, async / Ray actor / client / memory:", " / ".join(map(str, counts)))
    surface = read(rev, "kvckpt/buffer/surface.py") or ""
    if "TABLE" in surface:
        operations = re.findall(r'^    op\("([a-z_]+)"', surface, re.M)
        if rev is None:
            from kvckpt.buffer.surface import SURFACES, TABLE

            absent = {s: sum(not row.on(s).offered for row in TABLE) for s in SURFACES}
            print("operations not offered: 0 without a reason (an absent offer must say why);",
                  "absent with the table's reason:", absent)
    else:
        start = surface.index("OPERATIONS = (")
        operations = re.findall(r'"([a-z_]+)"', surface[start:surface.index(")", start)])
        declared = read(rev, "tests/core/test_surfaces.py") or ""
        print("operations not offered yet:", declared.count("NOT_YET") - 1)
    suite = "".join(text for path in CONFORMANCE if (text := read(rev, path)) is not None)
    driven = [op for op in operations if re.search(rf"\b(buf|SURFACE|surface)\.{op}\b", suite)]
    print(f"operations the conformance suite drives: {len(driven)} of {len(operations)};",
          "not driven:", sorted(set(operations) - set(driven)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
