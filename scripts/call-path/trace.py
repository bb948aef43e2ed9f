"""Reads trace.cpp's events and prints the files one call runs code from.

Note [Counting a call's files]
A file is on a call's path when one of its functions runs during the call
(the tracer is built at -O0 with -fno-inline, so inlined code counts too).
Declarations that run no code (types, options read as fields) do not count,
nor do the destructors the compiler writes for closures. A header and its
-inl.h are one unit, as they are one concept. The user's code (this tracer's
loss) and torch's are outside.

The files a reader follows are the *steps*: the private units that hand
control on to another private unit. A unit that calls none (a leaf: a
tensor split, a stream record, the chained programs, a timeline entry) is
a helper whose name says what it does, and the public headers (the options,
Split, Input, the schedules, and the stage adapters of model_pipeline.h
through which the executor calls the stages) are the user's vocabulary:
both are listed but not counted.

A unit is *entered again* when a function of another file calls into it
while it is already on the same thread's call stack below the caller: control
left it and comes back. The runtime's calls into the plan (its source,
target and loss) are listed apart; the issue allows them.
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
private = lambda u: u.startswith("mpipe/detail/")
calls_out = collections.defaultdict(set)  # private unit -> private units it calls into
for f in files:
    for src in sources[f]:
        if src in first and src != "(user)" and unit(src) != unit(f) and private(unit(f)):
            calls_out[unit(src)].add(unit(f))
units = []
for f in files:
    if unit(f) not in units:
        units.append(unit(f))
steps = [u for u in units if private(u) and calls_out[u]]
helpers = [u for u in units if private(u) and not calls_out[u]]
public = [u for u in units if not private(u)]
print("== %s: %d steps; code ran in %d units (%d files): %d helpers, %d public headers"
      % (call, len(steps), len(units), len(files), len(helpers), len(public)))
for u in steps:
    print("  step   %-44s -> %s" % (u, ", ".join(v.replace("mpipe/detail/", "") for v in sorted(calls_out[u]))))
print("  helpers: " + ", ".join(u.replace("mpipe/detail/", "") for u in helpers))
print("  public:  " + ", ".join(u.replace("mpipe/", "") for u in public))
print("  entered again (not from the runtime): %d" % sum(bounces.values()))
for (top, path, name), n in bounces.most_common():
    print("    %s -> %s (%s) x%d" % (top, path, name, n))
print("  the runtime's calls back into a file on the stack: %d" % sum(callbacks.values()))
for (top, path, name), n in callbacks.most_common():
    print("    %s -> %s (%s) x%d" % (top, path, name, n))
