#!/usr/bin/env python3
"""docs/api.md, mpipe's API reference, from the /// comments of the public headers.

Runs Doxygen with docs/Doxyfile.in (EXTRACT_ALL on, XML only, into a
temporary directory) and writes one line per public item of include/mpipe/
and include/mpipe/snn/ (not detail/, not namespace mpipe::detail): classes,
enums and their values, aliases, namespace-scope functions, public member
functions, public fields and TORCH_ARG options, macros; each with the brief
(first sentence) of its /// comment, grouped by header, in declaration order.
Left out: private and protected members, destructors, deleted functions,
friend classes, and macros whose names end in "_" (include guards, helpers).

  scripts/api-reference.py                    rewrites docs/api.md
  scripts/api-reference.py --output F --check docs/api.md
                                              writes F and fails if docs/api.md
                                              differs (the test docs.api_reference)

Either way it fails (exit status 1) when a public item has no /// brief,
except in the headers of PENDING_BRIEFS, whose missing briefs it lists.
The CMake target mpipe_api_reference and the test docs.api_reference run it.
Python 3 standard library only; the output depends only on the headers.
"""

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE = os.path.join(ROOT, "include")

# Headers whose public items may still lack a /// brief: listed, not failed.
# Empty it once they have theirs, so that every header is checked.
PENDING_BRIEFS = ()

# Section order: the pipeline and its calls first, then what they take, then
# the tools around them; the SNN toolkit last. Headers not named here follow,
# sorted, so a new header is never left out.
HEADER_ORDER = (
    "mpipe/model_pipeline.h", "mpipe/pipeline_options.h", "mpipe/training.h",
    "mpipe/split.h", "mpipe/tensors.h", "mpipe/skip.h", "mpipe/device.h",
    "mpipe/schedule.h", "mpipe/simulate.h", "mpipe/checkpoint.h", "mpipe/state.h",
    "mpipe/batchnorm.h", "mpipe/balance.h", "mpipe/timeline.h", "mpipe/memory.h",
    "mpipe/distributed.h", "mpipe/autocast.h", "mpipe/grad_scaler.h",
    "mpipe/linear.h", "mpipe/version.h", "mpipe/mpipe.h", "mpipe/snn.h",
    "mpipe/snn/neuron.h", "mpipe/snn/surrogate.h", "mpipe/snn/step_mode.h",
    "mpipe/snn/containers.h", "mpipe/snn/conv_block.h", "mpipe/snn/encoding.h",
    "mpipe/snn/poisson_encoder.h",
)

REGENERATE = "cmake --build build --target mpipe_api_reference (or scripts/api-reference.py)"

INTRO = """\
# mpipe API reference

Pipeline model parallelism for LibTorch, in C++17. Start with
`mpipe::ModelPipelineImpl` (mpipe/model_pipeline.h, used through its holder
`mpipe::ModelPipeline`): `append` stages, then call `forward`,
`constant_forward`, `sequence_forward`, `train_step` or `constant_train_step`,
with `ModelPipelineOptions` (mpipe/pipeline_options.h) and, per training step,
`TrainStepOptions` (mpipe/training.h). The [README](../README.md) explains the
semantics, restrictions and trade-offs, [docs/design.md](design.md) the
runtime.

Below, every public type, function, field and option of include/mpipe/ and
include/mpipe/snn/, by header, with the first sentence of its `///` comment;
names are relative to namespace `mpipe`. This page is generated from the
headers by scripts/api-reference.py (through Doxygen's XML): do not edit it,
edit the headers' `///` comments and run
`cmake --build build --target mpipe_api_reference`. The test
`docs.api_reference` fails when it is out of date, or when a public item has
no `///` comment.
"""


# ---------------------------------------------------------------------------
# Doxygen


def doxygen_config(outdir):
    """docs/Doxyfile.in as CMake configures it, plus this script's overrides."""
    with open(os.path.join(ROOT, "docs", "Doxyfile.in"), encoding="utf-8") as f:
        text = f.read()
    values = {"PROJECT_SOURCE_DIR": ROOT, "MPIPE_DOCS_OUT": outdir, "PROJECT_VERSION": ""}

    def substitute(m):
        if m.group(1) not in values:
            sys.exit("api-reference.py: docs/Doxyfile.in uses @%s@, which this script "
                     "does not know" % m.group(1))
        return values[m.group(1)]

    text = re.sub(r"@(\w+)@", substitute, text)
    # Later assignments win. Everything is extracted so that items without a
    # /// comment are seen (and reported); docs.doxygen checks the warnings.
    return text + "\n" + "\n".join([
        "OUTPUT_DIRECTORY = " + outdir,
        "GENERATE_HTML = NO", "GENERATE_LATEX = NO", "GENERATE_XML = YES",
        "XML_OUTPUT = xml", "XML_PROGRAMLISTING = NO",
        "EXTRACT_ALL = YES", "HIDE_UNDOC_MEMBERS = NO", "HIDE_UNDOC_CLASSES = NO",
        "QUIET = YES", "WARNINGS = NO", "WARN_AS_ERROR = NO",
    ]) + "\n"


def run_doxygen(doxygen, outdir):
    config = doxygen_config(outdir)
    proc = subprocess.run([doxygen, "-"], input=config.encode(), cwd=outdir,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout.decode(errors="replace"))
        sys.exit("api-reference.py: %s failed (exit status %d)" % (doxygen, proc.returncode))
    return os.path.join(outdir, "xml")


# ---------------------------------------------------------------------------
# Text


def squash(s):
    return " ".join(s.split())


def tidy_code(s):
    """A type, argument list or initializer as C++ is usually written."""
    s = squash(s)
    s = re.sub(r"\s+([&*]+)", r"\1", s)   # "const T &x" -> "const T& x"
    s = re.sub(r"([&*]+)(?=\w)", r"\1 ", s)
    s = re.sub(r"<\s+", "<", s)              # "std::vector< T >" -> "std::vector<T>"
    s = re.sub(r"\s+>", ">", s)
    return re.sub(r"\s+,", ",", s)


def code_text(e):
    return tidy_code("".join(e.itertext())) if e is not None else ""


SPECIAL = {"ndash": "--", "mdash": "---", "nonbreakablespace": " ", "linebreak": " ",
           "lsquo": "'", "rsquo": "'", "ldquo": '"', "rdquo": '"', "zwj": "", "zwnj": ""}


def escape_markdown(s):
    s = s.replace("\\", "\\\\").replace("*", "\\*").replace("`", "\\`")
    s = re.sub(r"<(?=[A-Za-z/!?])", r"\\<", s)
    return re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", s)


def markdown(e):
    """A Doxygen description element as one line of Markdown."""
    parts = []

    def walk(node):
        if node.text:
            parts.append(escape_markdown(node.text))
        for child in node:
            if child.tag == "computeroutput":
                code = squash("".join(child.itertext()))
                parts.append("``%s``" % code if "`" in code else "`%s`" % code)
            elif child.tag in ("emphasis", "bold"):
                mark = "*" if child.tag == "emphasis" else "**"
                parts.append(mark)
                walk(child)
                parts.append(mark)
            elif child.tag in SPECIAL:
                parts.append(SPECIAL[child.tag])
            elif child.tag in ("simplesect", "parameterlist"):
                pass  # \return, \param: not part of a brief
            else:
                walk(child)  # ref, ulink, para, ...: their text
            if child.tail:
                parts.append(escape_markdown(child.tail))

    if e is not None:
        walk(e)
    return squash("".join(parts))


def argument_list(argsstring):
    """"(const T &x, int n=1) const override" -> "(const T& x, int n = 1)".

    From Doxygen's argsstring, which keeps the declaration's default
    arguments (its <param> elements may come from a definition without them).
    """
    start = argsstring.find("(")
    if start < 0:
        return "()"
    depth, end = 0, len(argsstring)
    for i in range(start, len(argsstring)):
        depth += {"(": 1, ")": -1}.get(argsstring[i], 0)
        if depth == 0:
            end = i
            break
    inner = tidy_code(argsstring[start + 1:end])
    return "(%s)" % re.sub(r"\s*(?<![=!<>])=(?!=)\s*", " = ", inner)


# Doxygen ends a brief at the first ". "; these do not end a sentence.
ABBREVIATIONS = ("e.g.", "i.e.", "et al.", "vs.", "cf.")
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def brief_of(e):
    """The first sentence of e's /// comment, as Markdown."""
    brief = markdown(e.find("briefdescription"))
    if not brief.endswith(ABBREVIATIONS):
        return brief
    detail = e.find("detaileddescription")
    para = detail.find("para") if detail is not None else None
    if para is None:
        return brief
    text = brief + " " + markdown(para)
    for m in SENTENCE_END.finditer(text, len(brief)):
        if not text[:m.end()].endswith(ABBREVIATIONS):
            return text[:m.end()]
    return text


# ---------------------------------------------------------------------------
# Items


class Item:
    def __init__(self, header, line, column, text, brief, what):
        self.header = header      # "mpipe/state.h"
        self.line = line
        self.column = column
        self.text = text          # the signature, Markdown
        self.brief = brief        # "" when there is no /// comment
        self.what = what          # for the missing-brief report
        self.children = []

    def key(self):
        return (self.line, self.column, self.text)


def location(e):
    loc = e.find("location")
    if loc is None:
        return None, 0, 0
    f = loc.get("declfile") or loc.get("file")
    line = loc.get("declline") or loc.get("line") or "0"
    column = loc.get("declcolumn") or loc.get("column") or "0"
    return f, int(line), int(column)


def public_header(path):
    return (path is not None and path.endswith(".h") and path.startswith("mpipe/")
            and not path.startswith("mpipe/detail/")
            and os.path.isfile(os.path.join(INCLUDE, path)))


def public_scope(name):
    parts = name.split("::")
    return parts[0] == "mpipe" and "detail" not in parts


def short(name):
    return name[len("mpipe::"):] if name.startswith("mpipe::") else name


class Reader:
    def __init__(self, xmldir):
        self.xmldir = xmldir
        self.compounds = {}   # refid -> compounddef
        index = ET.parse(os.path.join(xmldir, "index.xml")).getroot()
        for c in index.findall("compound"):
            if c.get("kind") in ("class", "struct", "union", "namespace", "file"):
                path = os.path.join(xmldir, c.get("refid") + ".xml")
                for cd in ET.parse(path).getroot().findall("compounddef"):
                    self.compounds[cd.get("id")] = cd
        self.by_name = {cd.findtext("compoundname"): cd for cd in self.compounds.values()
                        if cd.get("kind") != "file"}
        self.sources = {}
        self.seen = set()
        self.by_header = None

    def source_line(self, header, line):
        if header not in self.sources:
            with open(os.path.join(INCLUDE, header), encoding="utf-8") as f:
                self.sources[header] = f.read().split("\n")
        lines = self.sources[header]
        return lines[line - 1] if 0 < line <= len(lines) else ""

    # Members -------------------------------------------------------------

    def member(self, m, scope, in_class):
        """The Item of memberdef `m` in compound `scope` (a name), or None."""
        kind = m.get("kind")
        name = m.findtext("name") or ""
        header, line, column = location(m)
        if not public_header(header) or m.get("id") in self.seen:
            return None
        if m.get("prot") != "public":
            return None
        args = m.findtext("argsstring") or ""
        qual = short(scope + "::" + name) if scope else name
        brief = brief_of(m)
        if kind == "function" or (kind == "friend" and "(" in args):
            if name.startswith("~") or re.search(r"=\s*delete\s*$", args):
                return None  # destructors and deleted operations: nothing to say
            if kind == "friend":
                qual = short(scope.rsplit("::", 1)[0] + "::" + name) if "::" in scope else name
            params = argument_list(args)
            text = "%s%s%s" % (qual, params, " const" if m.get("const") == "yes" else "")
            what = "function"
        elif kind == "friend":
            return None  # friend classes
        elif kind == "variable":
            vtype = code_text(m.find("type"))
            init = code_text(m.find("initializer"))
            if "TORCH_ARG(" in self.source_line(header, line):
                text = "%s(%s)" % (qual, vtype)
                default = re.sub(r"^=\s*", "", init)
                item = Item(header, line, column, "`%s`" % text, brief, "option")
                if default:
                    item.text += ", default `%s`" % default
                self.seen.add(m.get("id"))
                return item
            text = "%s %s%s" % (vtype, qual, (" " + init if init.startswith("=") else init))
            what = "field" if in_class else "variable"
        elif kind == "typedef":
            text = "using %s = %s" % (qual, code_text(m.find("type")))
            what = "alias"
        elif kind == "enum":
            text = "enum %s%s" % ("class " if m.get("strong") == "yes" else "", qual)
            item = Item(header, line, column, "`%s`" % text, brief, "enum")
            for v in m.findall("enumvalue"):
                vname = qual + "::" + v.findtext("name")
                vbrief = brief_of(v)
                child = Item(header, line, column, "`%s`" % vname, vbrief, "enum value")
                item.children.append(child)  # in declaration order
            self.seen.add(m.get("id"))
            return item
        elif kind == "define":
            if name.endswith("_"):
                return None  # include guards and helpers: internal by convention
            params = [p.findtext("defname") or "" for p in m.findall("param")]
            text = name + ("(%s)" % ", ".join(params) if m.find("param") is not None else "")
            what = "macro"
        else:
            return None
        self.seen.add(m.get("id"))
        return Item(header, line, column, "`%s`" % text, brief, what)

    def members(self, cd, scope, in_class, kinds=None):
        out = []
        for s in cd.findall("sectiondef"):
            for m in s.findall("memberdef"):
                if kinds is not None and m.get("kind") not in kinds:
                    continue
                item = self.member(m, scope, in_class)
                if item is not None:
                    out.append(item)
        return out

    # Classes -------------------------------------------------------------

    def klass(self, cd):
        name = cd.findtext("compoundname")
        header, line, column = location(cd)
        if not public_header(header) or not public_scope(name) or cd.get("prot") not in (None, "public"):
            return None
        kind = cd.get("kind")
        text = "%s %s" % (kind, short(name))
        tparams = cd.find("templateparamlist")
        if tparams is not None:
            ps = []
            for p in tparams.findall("param"):
                t = code_text(p.find("type"))
                d = p.findtext("declname")
                ps.append(t + (" " + d if d and not t.endswith(d) else ""))
            text = "template <%s> %s" % (", ".join(ps), text)
        bases = [short(code_text(b)) for b in cd.findall("basecompoundref") if b.get("prot") == "public"]
        if bases:
            text += " : " + ", ".join(bases)
        item = Item(header, line, column, "`%s`" % text, brief_of(cd), kind)
        item.children = self.members(cd, name, True)
        for ic in cd.findall("innerclass"):
            if ic.get("prot") != "public":
                continue
            inner = self.compounds.get(ic.get("refid"))
            child = self.klass(inner) if inner is not None else None
            if child is not None:
                item.children.append(child)
        item.children.sort(key=Item.key)
        return item

    def items(self):
        """Every public item, by header."""
        if self.by_header is None:
            self.by_header = self.collect()
        return self.by_header

    def collect(self):
        by_header = {}
        for cd in sorted(self.compounds.values(), key=lambda c: c.get("id")):
            kind = cd.get("kind")
            name = cd.findtext("compoundname") or ""
            found = []
            if kind == "namespace" and public_scope(name):
                found = self.members(cd, name, False)
            elif kind == "file":
                found = self.members(cd, "", False, kinds=("define",))  # the rest: namespaces
            elif kind in ("class", "struct", "union"):
                outer = self.by_name.get(name.rsplit("::", 1)[0] if "::" in name else "")
                if outer is not None and outer.get("kind") == "namespace":
                    k = self.klass(cd)
                    found = [k] if k is not None else []
            for item in found:
                by_header.setdefault(item.header, []).append(item)
        for items in by_header.values():
            items.sort(key=Item.key)
        return by_header

    def includes(self, header):
        for cd in self.compounds.values():
            if cd.get("kind") == "file" and location(cd)[0] == header:
                return [i.text for i in cd.findall("includes")
                        if i.text and public_header(i.text)]
        return []


# ---------------------------------------------------------------------------
# The page


def headers():
    found = []
    for sub in ("mpipe", "mpipe/snn"):
        d = os.path.join(INCLUDE, sub)
        found += [sub + "/" + f for f in os.listdir(d) if f.endswith(".h")]
    order = {h: i for i, h in enumerate(HEADER_ORDER)}
    return sorted(found, key=lambda h: (order.get(h, len(order)), h))


def render(reader):
    by_header = reader.items()
    out = [INTRO]
    for header in headers():
        out.append("## [%s](../include/%s)\n" % (header, header))
        items = by_header.get(header, [])
        if not items:
            incs = reader.includes(header)
            out.append("Declares nothing of its own; includes %s.\n" %
                       (", ".join("%s" % i for i in incs) if incs else "nothing of mpipe's"))
            continue

        def emit(item, depth):
            line = "  " * depth + "- " + item.text
            if item.brief:
                line += ": " + item.brief
            out.append(line)
            for child in item.children:
                emit(child, depth + 1)

        for item in items:
            emit(item, 0)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def describe(item):
    sig = item.text.split("`")[1]
    return sig if sig.startswith(item.what) else "%s %s" % (item.what, sig)


def missing_briefs(reader):
    missing = {}

    def visit(item):
        if not item.brief:
            missing.setdefault(item.header, []).append(item)
        for child in item.children:
            visit(child)

    for items in reader.items().values():
        for item in items:
            visit(item)
    return missing


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--doxygen", default="doxygen", help="the Doxygen executable")
    ap.add_argument("--output", default=os.path.join(ROOT, "docs", "api.md"),
                    help="where to write the page (default: docs/api.md)")
    ap.add_argument("--check", metavar="FILE",
                    help="fail if FILE differs from the page written to --output")
    ap.add_argument("--regenerate", default=REGENERATE,
                    help="the command named when --check fails")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="mpipe-api-") as tmp:
        reader = Reader(run_doxygen(args.doxygen, tmp))
        page = render(reader)
        missing = missing_briefs(reader)

    current = None
    if args.check:  # read first: --output may be the same file
        try:
            with open(args.check, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = ""
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8", newline="\n") as f:
        f.write(page)

    status = 0
    if current is not None:
        if current != page:
            diff = list(difflib.unified_diff(current.splitlines(), page.splitlines(),
                                             args.check, args.output, lineterm="", n=1))
            print("%s is out of date; the difference from the headers' /// comments:" % args.check)
            print("\n".join(diff[:40]))
            if len(diff) > 40:
                print("... (%d more lines)" % (len(diff) - 40))
            print("Regenerate it with: %s" % args.regenerate)
            status = 1
        else:
            print("%s is up to date." % args.check)

    strict = {h: v for h, v in missing.items() if h not in PENDING_BRIEFS}
    pending = {h: v for h, v in missing.items() if h in PENDING_BRIEFS}
    if pending:
        print("\nPublic items without a /// brief, allowed for now (PENDING_BRIEFS in "
              "scripts/api-reference.py):")
        for h in sorted(pending, key=headers().index):
            for item in pending[h]:
                print("  %s: %s" % (h, describe(item)))
    for h in PENDING_BRIEFS:
        if h not in missing and os.path.isfile(os.path.join(INCLUDE, h)):
            print("\n%s has a brief for every public item: remove it from PENDING_BRIEFS in "
                  "scripts/api-reference.py." % h)
    if strict:
        print("\nPublic items without a /// brief (add a one-sentence /// comment before each):")
        for h in sorted(strict, key=headers().index):
            for item in strict[h]:
                print("  %s: %s" % (h, describe(item)))
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
