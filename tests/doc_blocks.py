#!/usr/bin/env python3
"""Checks that the C++ and CMake code blocks of mpipe's docs are compiled code.

Each ```cpp or ```cmake block of the given Markdown files must start with a
comment naming a file of the repository that ctest compiles:
  // examples/first_program/main.cpp              the block is that whole file
  // excerpt of examples/tour/main.cpp            the block's lines are in it
(`#` instead of `//` in CMake blocks). An excerpt is a list of runs separated
by `// ...` lines; each run must equal consecutive lines of the file (leading
and trailing spaces aside), the runs in the file's order. Other blocks (sh,
text) are not checked. Usage: doc_blocks.py REPO_ROOT [FILE.md...]; without
files it checks README.md, docs/*.md and examples/*/README.md.
"""
import re
import sys
from pathlib import Path

MARK = re.compile(r"^(//|#) (excerpt of )?(\S+)\s*$")
ELISION = {"// ...", "# ...", "..."}


def blocks(text):
    """(line number, language, lines) of each fenced block."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if m:
            start, lang, body = i + 1, m.group(1), []
            i += 1
            while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
                body.append(lines[i])
                i += 1
            yield start, lang, body
        i += 1


def find_run(run, file_lines, start):
    """The first index >= start where `run` matches consecutive lines, or -1."""
    for k in range(start, len(file_lines) - len(run) + 1):
        if all(file_lines[k + j].strip() == run[j].strip() for j in range(len(run))):
            return k
    return -1


def check_block(root, doc, line, body):
    if not body:
        return f"{doc}:{line}: an empty code block"
    indent = len(body[0]) - len(body[0].lstrip())
    body = [b[indent:] if b[:indent].strip() == "" else b for b in body]
    m = MARK.match(body[0])
    if not m:
        return (f"{doc}:{line}: the block does not start with the file it comes from "
                f"('// excerpt of <path>' or '// <path>'); it starts: {body[0]!r}")
    path = root / m.group(3)
    if not path.is_file():
        return f"{doc}:{line}: {m.group(3)} does not exist"
    file_lines = path.read_text().split("\n")
    rest = body[1:]
    if not m.group(2):  # the whole file
        if "\n".join(rest).rstrip("\n") != "\n".join(file_lines).rstrip("\n"):
            return f"{doc}:{line}: the block is not {m.group(3)} as it is now"
        return None
    runs, run = [], []
    for b in rest:
        if b.strip() in ELISION:
            if run:
                runs.append(run)
            run = []
        elif b.strip() or run:
            run.append(b)
    if run:
        runs.append(run)
    while runs and runs[-1] and not runs[-1][-1].strip():
        runs[-1].pop()
    pos = 0
    for r in runs:
        k = find_run(r, file_lines, pos)
        if k < 0:
            return (f"{doc}:{line}: these lines are not, in this order, lines of "
                    f"{m.group(3)}:\n    " + "\n    ".join(r))
        pos = k + len(r)
    return None


def main():
    root = Path(sys.argv[1])
    errors, checked = [], 0
    docs = sys.argv[2:] or (["README.md"] +
                            sorted(str(p.relative_to(root)) for p in root.glob("docs/*.md")) +
                            sorted(str(p.relative_to(root)) for p in root.glob("examples/*/README.md")))
    for doc in docs:
        text = (root / doc).read_text()
        for line, lang, body in blocks(text):
            if lang not in ("cpp", "cmake"):
                continue
            checked += 1
            e = check_block(root, doc, line, body)
            if e:
                errors.append(e)
    for e in errors:
        print(e)
    print(f"{checked} code blocks checked, {len(errors)} not compiled code")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
