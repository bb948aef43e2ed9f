"""Reads trace.cpp's events and prints the files one call runs code from.

Note [Counting a call's files]
A file is on a call's path when one of its functions runs during the call
(inlined or not: the tracer is built at -O0 with -fno-inline). Declarations
that run no code (types, options read as fields) do not count. The user's own
code (this tracer's loss) and torch's are outside. A file is *entered* when a
function of another file calls into it, or when a worker thread starts in it.
A *bounce* is an entry into a file that is already on the same thread's call
stack below the caller: control left the file and comes back into it from
further down. Bounces from the runtime (the executor calling the plan's
source, target and loss, which the issue allows) are listed apart.
"""
import collections
import re
import subprocess
import sys

binary, events_path, call, include = sys.argv[1:5]
events = [line.split() for line in open(events_path)]
addrs = sorted({e[2] for e in events})
out = subprocess.run(["addr2line", "-f", "-C", "-e", binary] + addrs,
                     capture_output=True, text=True, check=True).stdout.splitlines()
where = {}
for i, a in enumerate(addrs):
    fn, loc = out[2 * i], out[2 * i + 1]
    path = loc.rsplit(":", 1)[0]
    if path.startswith(include):
        path = path[len(include):]
    elif path.endswith("trace.cpp"):
        path = "(user)"
    where[a] = (path, fn)

stacks = collections.defaultdict(list)
entries = collections.Counter()
sources = collections.defaultdict(collections.Counter)
first = {}
bounces, callbacks = collections.Counter(), collections.Counter()
def closure_destructor(name):
    return "{lambda" in name and "::~" in name

for thread, kind, fn, _ in events:
    path, name = where[fn]
    if closure_destructor(name):
        continue
    stack = stacks[thread]
    if kind == ">":
        top = stack[-1] if stack else "(thread start)"
        if path != top:
            entries[path] += 1
            sources[path][top] += 1
            first.setdefault(path, len(first))
            if path in stack:
                short = name.split("(")[0][-60:]
                (callbacks if top.startswith("mpipe/detail/runtime/") else bounces)[
                    (top, path, short)] += 1
        stack.append(path)
    else:
        while stack and stack[-1] != path:
            stack.pop()
        if stack:
            stack.pop()

files = [f for f in sorted(first, key=first.get) if f != "(user)"]
unit = lambda f: re.sub(r"(_cuda|_none)?-inl\.h$", ".h", f)
calls_out = collections.defaultdict(set)  # unit -> units it calls into
for f in files:
    for s in sources[f]:
        if s in first and s != "(user)" and unit(s) != unit(f):
            calls_out[unit(s)].add(unit(f))
units = sorted({unit(f) for f in files}, key=lambda u: min(first[f] for f in files if unit(f) == u))
spine = [u for u in units if calls_out[u]]
public = [f for f in files if f.count("/") == 1]
print("== %s: %d files with code on the path (%d public headers among them)"
      % (call, len(files), len(public)))
for f in files:
    print("  %-50s entered %4d times, from %s" % (
        f, entries[f], ", ".join("%s x%d" % (s, n) for s, n in sources[f].most_common(4))))
print("  %d units (a header with its -inl.h), %d of them calling into another (the spine):"
      % (len(units), len(spine)))
for u in spine:
    print("    %-48s -> %s" % (u, ", ".join(sorted(calls_out[u]))))
print("  bounces (back into a file already on the stack, not from the runtime): %d"
      % sum(bounces.values()))
for (top, path, name), n in bounces.most_common():
    print("    %s -> %s (%s) x%d" % (top, path, name, n))
print("  the runtime's callbacks into the call's files: %d" % sum(callbacks.values()))
for (top, path, name), n in callbacks.most_common():
    print("    %s -> %s (%s) x%d" % (top, path, name, n))
