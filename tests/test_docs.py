"""The documentation says what the repository does: README.md and docs/*.md checked against it.

- README.md stays short: at most ``README_MAX_LINES`` lines.
- Links: every relative link and image (``[text](path)``, ``[text](path#anchor)``, reference definitions,
  ``href=``/``src=`` in HTML) resolves to a file or folder inside the repository that git does not ignore
  (bench/out/ exists only after a run); an ``#anchor`` into a .md file names one of its headings by
  GitHub's slug rules (lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats),
  ``#L10`` / ``#L10-L20`` into another file is within its length. Links with a scheme (``https:``) are
  not fetched.
- ``make TARGET``: every target shown, in code blocks or inline code, is a rule of the Makefile (parsed
  here; ``make -n`` would start installs). ``make TARGET VAR="args"`` where TARGET's recipe runs
  ``$(PY) SCRIPT ... $(VAR)``: those args are checked as a command line of SCRIPT (below).
- Command lines that run the repository's Python (``python SCRIPT.py ...``, ``python -m osp.MODULE ...``,
  alone or behind ``horovodrun``, ``torchrun`` / ``python -m torch.distributed.run``, ``mpirun``): the
  script or module exists, and its real argparse parser accepts the argv shown. A subprocess of the venv's
  python patches ``argparse.ArgumentParser.parse_args`` / ``parse_known_args`` to parse the real argv and
  then raise ``SystemExit(0)`` instead of running the job, and runs the script with runpy as ``__main__``.
  The launchers' own flags go through their own parsers the same way (horovodrun's and torchrun's, which
  also split off the command they start); mpirun's are not checked (Open MPI parses them in C): the
  command starts at its first ``python`` word. A script or module whose source has no argparse is not run
  (it could start the job): it only has to exist.

Which command lines count: in fenced blocks marked ``sh``/``bash``/``shell``/``console`` or unmarked
(``python`` and ``text`` blocks are code and output), each logical line (``\\`` continuations joined,
heredoc bodies skipped, ``#`` comments, ``$`` prompts and redirections dropped, split at ``&&``, ``||``,
``;``, ``|``), and every inline code span, whose first word after ``VAR=value`` assignments is ``make``,
``python``/``python3``/``.venv/bin/python``, ``torchrun``, ``horovodrun`` or ``mpirun``. Commands of
other programs (``python -m pytest``, ``pip``, ``cat``) are not checked. Inline, a program's name alone
(``torchrun``) or a launcher with an option but no program (``torchrun --max-restarts``) names the
tool, not a command line, and is not checked; in a code block every such line is a command.

Placeholders: a command that holds ``...``, a ``<name>`` token, an argparse-style metavar in capitals
(``N``, ``DIR``, ``RANK:STEP``), an ``[--optional]`` bracket or an ``a|b`` alternative is a template, not
an argv: it is not parsed as is (``--checkpoint-every N`` is no integer), but its script or module must
exist and every ``--option`` in it must be an option of the script's parser (or an unambiguous prefix of
one, as argparse allows). File names such as ``RUN.json`` are ordinary values to argparse and parsed as
they are. Launcher flags (before the program) must be real values: a template is checked only in the
program's own arguments.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_PY = ROOT / ".venv" / "bin" / "python"
PYTHON = str(VENV_PY) if VENV_PY.exists() else sys.executable
WORKERS = 2  # subprocesses at once (each imports torch); the checks take seconds, not minutes

SHELL_FENCES = {"", "sh", "bash", "shell", "console", "zsh"}
LAUNCHERS = {"torchrun": "torchrun", "horovodrun": "horovodrun", "mpirun": "mpirun", "mpiexec": "mpirun"}
CONTROL = {"&&", "||", ";", "|", "&"}
REDIRECT = re.compile(r"^(\d?>>?|&>|<|\d?>&\d)$")
REDIRECT_GLUED = re.compile(r"^(\d?>>?|&>)\S+$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def is_python(word: str) -> bool:
    return re.fullmatch(r"python(\d+(\.\d+)?)?", os.path.basename(word)) is not None


# -- markdown --------------------------------------------------------------------------------------
@dataclass
class Doc:
    path: Path
    fences: List[Tuple[str, int, List[str]]] = field(default_factory=list)  # (info, first line, lines)
    paragraphs: List[Tuple[int, str]] = field(default_factory=list)  # (first line, text), outside fences
    headings: List[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


def parse_markdown(path: Path, text: Optional[str] = None) -> Doc:
    doc = Doc(path)
    raw = path.read_text() if text is None else text
    # HTML comments are not shown; their lines stay, so line numbers do not move
    lines = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), raw, flags=re.S).split("\n")
    fence: Optional[Tuple[str, str, int, List[str]]] = None  # (marker, info, start, body)
    para: List[str] = []
    start = 0

    def end_paragraph():
        if para:
            doc.paragraphs.append((start, "\n".join(para)))
            para.clear()

    for n, line in enumerate(lines, 1):
        if fence is not None:
            marker = fence[0]
            if re.match(rf"^\s*{re.escape(marker[0])}{{{len(marker)},}}\s*$", line):
                doc.fences.append((fence[1], fence[2], fence[3]))
                fence = None
            else:
                fence[3].append(line)
            continue
        m = re.match(r"^\s{0,3}(`{3,}|~{3,})\s*([^`\s]*)", line)
        if m:
            end_paragraph()
            fence = (m.group(1), m.group(2).lower(), n + 1, [])
            continue
        if not line.strip():
            end_paragraph()
            continue
        h = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if h:
            end_paragraph()
            doc.headings.append(h.group(1))
            doc.paragraphs.append((n, h.group(1)))
            continue
        if not para:
            start = n
        para.append(line)
    end_paragraph()
    if fence is not None:
        doc.fences.append((fence[1], fence[2], fence[3]))
    return doc


CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def code_spans(doc: Doc) -> List[Tuple[int, str]]:
    out = []
    for start, text in doc.paragraphs:
        for m in CODE_SPAN.finditer(text):
            out.append((start + text.count("\n", 0, m.start()), " ".join(m.group(2).split())))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lower case, without punctuation (letters,
    digits, ``_``, ``-`` and spaces stay), spaces turned into hyphens."""
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", "", heading)  # images
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # html tags
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"(?<![\w])_+|_+(?![\w])", "", text)  # _emphasis_, not snake_case
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(doc: Doc) -> set:
    seen: Dict[str, int] = {}
    out = set()
    for h in doc.headings:
        slug = github_slug(h)
        k = seen.get(slug, 0)
        out.add(slug if k == 0 else f"{slug}-{k}")
        seen[slug] = k + 1
    for _, text in doc.paragraphs:  # explicit HTML anchors
        out.update(re.findall(r"<a\s+(?:name|id)=[\"']([^\"']+)[\"']", text))
    return out


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HTML_REF = re.compile(r"\b(?:href|src)=[\"']([^\"']+)[\"']")


def links(doc: Doc) -> List[Tuple[int, str]]:
    out = []
    for start, text in doc.paragraphs:
        bare = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)
        for rx in (LINK, REF_DEF, HTML_REF):
            for m in rx.finditer(bare):
                out.append((start + bare.count("\n", 0, m.start()), m.group(1)))
    return out


# -- shell command lines ---------------------------------------------------------------------------
@dataclass
class Command:
    doc: str
    line: int
    text: str
    argv: List[str]  # the simple command, assignments before it stripped
    env: Dict[str, str]

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}: {' '.join(self.text.split())}"


def logical_lines(info: str, start: int, body: List[str]) -> List[Tuple[int, str]]:
    out, buf, first, heredoc = [], "", 0, None
    for n, raw in enumerate(body, start):
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        line = raw
        if info == "console":
            if not line.startswith("$ ") and not buf:
                continue  # output
            line = line[2:] if line.startswith("$ ") else line
        if not buf:
            first = n
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        m = re.search(r"<<-?\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)['\"]?", buf)
        if m:
            heredoc = m.group(1)
        out.append((first, buf))
        buf = ""
    if buf:
        out.append((first, buf))
    return out


def simple_commands(doc: str, line: int, text: str) -> List[Command]:
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as e:  # a problem only where the line is one of the commands checked here
        words = [w for w in text.split() if not ASSIGNMENT.match(w)]
        return [Command(doc, line, text, ["<unparsable>", str(e)], {})] if words and is_checked(words[:1]) else []
    out, cur = [], []
    for tok in tokens + [";"]:
        if tok in CONTROL:
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(tok)
    cmds = []
    for words in out:
        kept, skip = [], False
        for w in words:  # redirections and their files
            if skip:
                skip = False
            elif REDIRECT.match(w):
                skip = True
            elif not REDIRECT_GLUED.match(w):
                kept.append(w)
        env = {}
        while kept and ASSIGNMENT.match(kept[0]):
            k, v = kept.pop(0).split("=", 1)
            env[k] = v
        while kept and kept[0] in ("env", "sudo", "exec", "time", "nohup"):
            kept.pop(0)
            while kept and ASSIGNMENT.match(kept[0]):
                k, v = kept.pop(0).split("=", 1)
                env[k] = v
        if kept:
            cmds.append(Command(doc, line, text.strip(), kept, env))
    return cmds


def launcher(word: str) -> Optional[str]:
    return LAUNCHERS.get(os.path.basename(word))


def is_checked(argv: List[str]) -> bool:
    return argv[0] in ("make", "<unparsable>") or launcher(argv[0]) is not None or is_python(argv[0])


def names_a_program(argv: List[str]) -> bool:
    """Whether a launcher's argv names what it starts (``torchrun ... -m osp.train``); inline, ``torchrun``
    or ``torchrun --max-restarts`` alone names the launcher or one of its options, and is not a command."""
    return any(is_python(w) or w.endswith(".py") or w in ("-m", "--module") for w in argv[1:])


def commands(doc: Doc, inline: bool = True) -> List[Command]:
    """The repository command lines of ``doc``: its shell blocks' and (``inline``) its inline code spans'."""
    out = []
    for info, start, body in doc.fences:
        if info not in SHELL_FENCES:
            continue
        for n, text in logical_lines(info, start, body):
            out.extend(c for c in simple_commands(doc.name, n, text) if is_checked(c.argv))
    for n, text in code_spans(doc) if inline else ():
        for c in simple_commands(doc.name, n, text):
            if not is_checked(c.argv) or (len(c.argv) == 1 and c.argv[0] != "make"):
                continue  # `python`, `torchrun`: a program's name
            if launcher(c.argv[0]) and not names_a_program(c.argv):
                continue
            out.append(c)
    return out


# -- the Makefile ----------------------------------------------------------------------------------
def makefile_rules(path: Path = ROOT / "Makefile") -> Dict[str, List[str]]:
    """Target -> its recipe lines (tab-indented lines after the rule; continuations joined)."""
    rules: Dict[str, List[str]] = {}
    current: List[str] = []
    lines = path.read_text().replace("\\\n", " ").split("\n")
    for line in lines:
        if line.startswith("\t"):
            current.append(line.strip())
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.match(r"^([^:=#\s\t][^:=#]*?)\s*::?(?!=)", line)
        current = []
        if m:
            for name in m.group(1).split():
                if "%" not in name and "$" not in name and not name.startswith("."):
                    current = rules.setdefault(name, current)
    return rules


def make_checks(cmd: Command, rules: Dict[str, List[str]]) -> Tuple[List[str], List[Tuple[str, List[str]]]]:
    """Problems with ``make ...`` (unknown targets), and the argv of each script its variables reach."""
    problems, argvs = [], []
    args = cmd.argv[1:]
    variables = dict(cmd.env)
    targets = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in ("-C", "-f", "-j", "-I", "-o", "-W"):
            skip = True
            if a in ("-C", "-f"):
                problems.append(f"{cmd.where}: make {a} is not checked by tests/test_docs.py")
        elif a.startswith("-"):
            continue
        elif ASSIGNMENT.match(a):
            k, v = a.split("=", 1)
            variables[k] = v
        else:
            targets.append(a)
    for t in targets:
        if t not in rules:
            problems.append(f"{cmd.where}: make target {t!r} is not in the Makefile "
                            f"(targets: {', '.join(sorted(rules))})")
            continue
        for recipe in rules[t]:
            words = shlex.split(recipe.lstrip("@-+"))
            while words and ASSIGNMENT.match(words[0]):
                words.pop(0)
            refs = {w[2:-1] for w in words if re.fullmatch(r"\$\([A-Za-z_]+\)", w)}
            given = refs & set(variables)
            if not words or words[0] != "$(PY)" or not given:
                continue
            argv = ["python"]
            for w in words[1:]:
                if re.fullmatch(r"\$\([A-Za-z_]+\)", w):
                    argv += shlex.split(variables.get(w[2:-1], ""))
                else:
                    argv.append(w)
            argvs.append((f"{cmd.where} (recipe: {recipe})", argv))
    return problems, argvs


# -- the checks in a subprocess --------------------------------------------------------------------
PLACEHOLDER = re.compile(r"^(\.\.\.|…|<[^<>]+>|[A-Z][A-Z0-9_]*(:[A-Z][A-Z0-9_]*)*)$|^\[|\]$|\|")

WORKER = r'''
import argparse, contextlib, importlib.util, io, json, os, runpy, sys, traceback, warnings
warnings.simplefilter("ignore")
ROOT = os.getcwd()
REPO_PACKAGES = {"bench", "scripts", "tests"} | {d for d in os.listdir(os.path.join(ROOT, "python"))
                                               if os.path.isdir(os.path.join(ROOT, "python", d))}
real_parse_args = argparse.ArgumentParser.parse_args
real_parse_known = argparse.ArgumentParser.parse_known_args
state = {"inside": False, "mode": "run", "parsed": None, "template": None}

class Launcher(Exception):
    pass

class Parsed(SystemExit):
    def __init__(self):
        super().__init__(0)

def template_check(parser, argv):
    known = parser._option_string_actions
    bad = []
    for tok in argv:
        tok = tok.strip("[]")
        if not tok.startswith("-") or tok in ("-", "--") or tok[1:2].isdigit():
            continue
        opt = tok.split("=", 1)[0]
        if opt in known:
            continue
        hits = [o for o in known if o.startswith(opt)] if opt.startswith("--") else []
        if len(hits) != 1:
            bad.append(opt)
    if bad:
        sys.stderr.write(f"unrecognized options in the template: {' '.join(bad)}\n")
        raise SystemExit(2)

def intercept(real):
    def patched(self, args=None, namespace=None):
        if state["inside"]:
            return real(self, args, namespace)
        state["inside"] = True
        try:
            argv = sys.argv[1:] if args is None else list(args)
            if state["mode"] == "run" and state["template"] is not None:
                template_check(self, argv)
                result = None
            else:
                result = real(self, args, namespace)
        finally:
            state["inside"] = False
        if state["mode"] == "launcher":
            raise Launcher(result[0] if isinstance(result, tuple) else result)
        state["parsed"] = True
        raise Parsed()
    return patched

argparse.ArgumentParser.parse_args = intercept(real_parse_args)
argparse.ArgumentParser.parse_known_args = intercept(real_parse_known)

def launcher_args(run, argv0, argv):
    state["mode"] = "launcher"
    old = sys.argv
    sys.argv = [argv0, *argv]
    state["launcher_err"] = io.StringIO()
    try:
        with contextlib.redirect_stderr(state["launcher_err"]):
            run()
    except Launcher as e:
        return e.args[0]
    finally:
        state["mode"] = "run"
        sys.argv = old
    raise RuntimeError(f"{argv0}: its parser was never called")

def said_by_parser():
    err = state.get("launcher_err")
    lines = [x for x in (err.getvalue() if err else "").split("\n") if x.strip()]
    return "\n".join([x for x in lines if "error:" in x] or lines[-3:])

def horovodrun(argv):
    import horovod.runner.launch as launch
    ns = launcher_args(launch.parse_args, "horovodrun", argv)
    return program(ns.command, "horovodrun")

def torchrun(argv):
    import torch.distributed.run as trun
    ns = launcher_args(lambda: trun.get_args_parser().parse_args(), "torchrun", argv)
    if ns.no_python:
        return program([ns.training_script, *ns.training_script_args], "torchrun --no-python")
    if ns.module:
        return python(["-m", ns.training_script, *ns.training_script_args])
    return python([ns.training_script, *ns.training_script_args])

def mpirun(argv):
    for i, w in enumerate(argv):
        if os.path.basename(w).startswith("python"):
            return program(argv[i:], "mpirun")
    return ("external", "mpirun starts no python")

def program(argv, who):
    if not argv:
        return ("fail", f"{who}: no command to run")
    if os.path.basename(argv[0]).startswith("python"):
        return python(argv[1:])
    if argv[0].endswith(".py"):
        return python(argv)
    return ("external", f"{who} runs {argv[0]}")

PY_FLAGS_WITH_ARG = {"-W", "-X", "-Q"}

def python(argv):
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c", "-"):
        i += 2 if argv[i] in PY_FLAGS_WITH_ARG else 1
    if i >= len(argv) or argv[i] in ("-c", "-"):
        return ("external", "python -c / stdin")
    if argv[i] == "-m":
        if i + 1 >= len(argv):
            return ("fail", "python -m without a module")
        mod, rest = argv[i + 1], argv[i + 2:]
        if mod == "torch.distributed.run":
            return torchrun(rest)
        if mod.split(".")[0] not in REPO_PACKAGES:
            return ("external", f"module {mod}")
        try:
            spec = importlib.util.find_spec(mod)
        except ImportError as e:
            return ("fail", f"no module {mod}: {e}")
        if spec is None:
            return ("fail", f"no module {mod}")
        origin = spec.origin
        if spec.submodule_search_locations:
            main = importlib.util.find_spec(mod + ".__main__")
            if main is None:
                return ("fail", f"{mod} is a package without __main__")
            origin = main.origin
        return run(origin, rest, lambda: runpy.run_module(mod, run_name="__main__", alter_sys=True))
    script, rest = argv[i], argv[i + 1:]
    path = os.path.join(ROOT, script)
    if not os.path.isfile(path):
        return ("fail", f"no script {script}")
    def go():
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        try:
            runpy.run_path(path, run_name="__main__")
        finally:
            sys.path.pop(0)
    return run(path, rest, go, script)

def run(origin, rest, go, argv0=None):
    with open(origin) as f:
        if "argparse" not in f.read():
            return ("exists", "no argparse: not run")
    state["parsed"] = None
    old = sys.argv
    sys.argv = [argv0 or origin, *rest]
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            go()
    except Parsed:
        return ("ok", "parsed")
    except SystemExit as e:
        if e.code in (0, None):
            return ("ok", "exited 0 while parsing (--help)")
        lines = [x for x in err.getvalue().strip().split("\n") if x.strip()]
        said = [x for x in lines if "error:" in x] or lines[-3:]  # argparse's verdict, not its usage
        return ("fail", ("\n".join(said) or f"exit status {e.code}")[-2000:])
    except BaseException:
        return ("fail", traceback.format_exc()[-2000:])
    finally:
        sys.argv = old
    return ("fail", "ran to the end without parsing its arguments")

results = []
for job in json.load(open(sys.argv[1])):
    state["template"] = job["template"]
    kind, argv = job["kind"], job["argv"]
    try:
        if kind == "python":
            res = python(argv[1:])
        elif kind == "torchrun":
            res = torchrun(argv[1:])
        elif kind == "horovodrun":
            res = horovodrun(argv[1:])
        else:
            res = mpirun(argv[1:])
    except SystemExit as e:
        res = ("fail", f"the launcher's parser refused it (exit status {e.code}): {said_by_parser()}")
    except BaseException:
        res = ("fail", traceback.format_exc()[-2000:])
    results.append(res)
json.dump(results, open(sys.argv[2], "w"))
'''


def job_for(argv: List[str]) -> dict:
    template = any(PLACEHOLDER.search(w) for w in argv)
    kind = "python" if is_python(argv[0]) else launcher(argv[0])
    return {"kind": kind, "argv": argv, "template": template or None}


def run_jobs(jobs: List[dict]) -> List[Tuple[str, str]]:
    """Each job's (outcome, detail), from WORKERS subprocesses of the venv's python."""
    if not jobs:
        return []
    shares = [list(range(k, len(jobs), WORKERS)) for k in range(WORKERS)]
    shares = [s for s in shares if s]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for k, idx in enumerate(shares):
            src, dst = os.path.join(tmp, f"jobs{k}.json"), os.path.join(tmp, f"results{k}.json")
            with open(src, "w") as f:
                json.dump([jobs[i] for i in idx], f)
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
            procs.append((idx, dst, subprocess.Popen([PYTHON, "-c", WORKER, src, dst], cwd=ROOT, env=env,
                                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True)))
        out: List[Optional[Tuple[str, str]]] = [None] * len(jobs)
        for idx, dst, p in procs:
            log, _ = p.communicate(timeout=300)
            assert p.returncode == 0 and os.path.exists(dst), f"the command checker failed:\n{log[-3000:]}"
            with open(dst) as f:
                for i, res in zip(idx, json.load(f)):
                    out[i] = tuple(res)
    return out  # type: ignore[return-value]


# -- the tests -------------------------------------------------------------------------------------
PARSED = {p: parse_markdown(p) for p in DOCS}
IDS = [str(p.relative_to(ROOT)) for p in DOCS]


def test_the_docs_exist():
    names = {p.name for p in DOCS}
    assert "README.md" in names and {"design.md", "api.md", "modes.md", "faults.md", "benchmarks.md",
                                     "testing.md", "plan.md", "horovod.md", "ddp.md", "lightning.md",
                                     "accelerate.md", "compression.md", "works-with.md"} <= names, names


README_MAX_LINES = 250  # a newcomer reads it in five minutes; the tables and recipes live in docs/


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move detail into docs/")


def test_no_install_line_names_a_package_that_is_not_published():
    """osp is not on PyPI: 'pip install osp[lightning]' fails (or installs someone else's 'osp'); from a
    checkout it is 'pip install -e ".[lightning]"'."""
    import re
    bad = re.compile(r"pip install ['\"]?osp\b")
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "python" / "osp").rglob("*.py")), *sorted((ROOT / "examples").glob("*.py"))]
    found = [f"{f.relative_to(ROOT)}:{i}" for f in files for i, line in enumerate(f.read_text().split("\n"), 1)
             if bad.search(line)]
    assert not found, found


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_relative_links_resolve(path):
    doc = PARSED[path]
    problems, targets = [], []
    for line, target in links(doc):
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            continue
        where = f"{doc.name}:{line}: ({target})"
        rel, _, anchor = target.partition("#")
        dest = (path.parent / rel).resolve() if rel else path
        if ROOT not in dest.parents and dest != ROOT:
            problems.append(f"{where}: points outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: no such file or folder")
            continue
        targets.append((where, dest))
        if not anchor:
            continue
        if dest.suffix == ".md":
            if anchor not in anchors(PARSED.get(dest) or parse_markdown(dest)):
                problems.append(f"{where}: no heading with the anchor #{anchor} in {dest.relative_to(ROOT)}")
        elif re.fullmatch(r"L\d+(-L\d+)?", anchor):
            last = int(anchor.split("-")[-1][1:])
            if last > len(dest.read_text().split("\n")):
                problems.append(f"{where}: {dest.relative_to(ROOT)} has fewer than {last} lines")
        else:
            problems.append(f"{where}: #{anchor} cannot be checked in a file that is not markdown")
    if targets:
        ignored = subprocess.run(["git", "check-ignore", "--stdin"], cwd=ROOT, text=True, capture_output=True,
                                 input="\n".join(str(d) for _, d in targets))
        if ignored.returncode in (0, 1):  # 1: none ignored; 128: not a git checkout
            bad = set(ignored.stdout.split("\n")) - {""}
            problems += [f"{w}: git ignores it (it exists only here)" for w, d in targets if str(d) in bad]
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_make_targets_exist(path):
    rules = makefile_rules()
    problems = []
    for cmd in commands(PARSED[path]):
        if cmd.argv[0] == "make":
            problems += make_checks(cmd, rules)[0]
        elif cmd.argv[0] == "<unparsable>":
            problems.append(f"{cmd.where}: not a shell command line ({cmd.argv[1]})")
    assert not problems, "\n".join(problems)


def check_commands(docs: List[Doc]) -> List[Tuple[str, str, List[str], Tuple[str, str]]]:
    """Every repository command line of ``docs``, each distinct argv checked once:
    (doc, where, argv, (outcome, detail)), outcome one of ok, exists, external, fail."""
    rules = makefile_rules()
    entries: List[Tuple[str, str, List[str]]] = []  # (doc, where, argv)
    for doc in docs:
        for cmd in commands(doc):
            if cmd.argv[0] == "make":
                entries += [(cmd.doc, where, argv) for where, argv in make_checks(cmd, rules)[1]]
            elif cmd.argv[0] != "<unparsable>":
                entries.append((cmd.doc, cmd.where, cmd.argv))
    unique = sorted({json.dumps(argv) for _, _, argv in entries})
    results = dict(zip(unique, run_jobs([job_for(json.loads(a)) for a in unique])))
    return [(doc, where, argv, results[json.dumps(argv)]) for doc, where, argv in entries]


@pytest.fixture(scope="module")
def command_results():
    return check_commands([PARSED[p] for p in DOCS])


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_commands_parse(path, command_results):
    name = str(path.relative_to(ROOT))
    mine = [r for r in command_results if r[0] == name]
    problems = [f"{where}\n    {detail}" for _, where, _, (outcome, detail) in mine if outcome == "fail"]
    assert not problems, f"{len(problems)} command line(s) that do not run as shown:\n" + "\n".join(problems)


def test_every_flag_and_choice_of_osp_train_is_in_its_table():
    """docs/api.md's table of ``osp.train`` names every option of its parser, and every choice of each option
    with ``choices`` in that option's row (``--sync fsdp`` ran undocumented)."""
    sys.path.insert(0, str(ROOT / "python"))
    from osp.train import build_parser
    text = (ROOT / "docs" / "api.md").read_text()
    rows = [ln for ln in text.split("\n") if ln.startswith("| `--")]
    problems = []
    for action in build_parser()._actions:
        flags = [f for f in action.option_strings if f.startswith("--") and f != "--help"]
        if not flags:
            continue
        row = next((r for r in rows if any(re.search(rf"`{re.escape(f)}[` ]", r.split("|")[1]) for f in flags)),
                   None)
        if row is None:
            problems.append(f"{flags[0]}: no row in docs/api.md's table")
            continue
        problems += [f"{flags[0]} {c}: not in its row" for c in action.choices or ()
                     if f"`{c}`" not in row and not any(f"`{f} {c}`" in row for f in flags)]
    assert not problems, "\n".join(problems)


VENV_PROGRAMS = ("python", "python3", "torchrun", "horovodrun")  # what `make install` puts in .venv/bin alone


def bare_venv_programs(doc: Doc) -> List[str]:
    """The README's command blocks, as a newcomer runs them from a fresh shell (no venv activated): a program
    that only ``make install``'s venv has (torch, Horovod, osp: python, torchrun, horovodrun), named bare
    rather than as ``.venv/bin/...``, whether first on the line or started by a launcher; each as ``where``."""
    bad = []
    for c in commands(doc, inline=False):
        progs = [c.argv[0]] + [w for w in c.argv[1:] if os.path.basename(w) in VENV_PROGRAMS][:1]
        bad += [f"{c.where}: {w!r} (as .venv/bin/{w})" for w in progs if w in VENV_PROGRAMS]
    return bad


def test_readme_commands_run_from_a_fresh_shell():
    """Every README command runs as written after ``make install``, with no venv activated: the programs of the
    venv are named ``.venv/bin/...`` (a bare ``horovodrun`` is 'No such file or directory', a bare ``python``
    has no torch and no osp)."""
    bad = bare_venv_programs(PARSED[ROOT / "README.md"])
    assert not bad, "README command lines that fail in a fresh shell:\n" + "\n".join(bad)
    sample = parse_markdown(ROOT / "docs" / "sample.md", "```\nhorovodrun -np 2 .venv/bin/python -m osp.train\n"
                            "mpirun -np 2 python -m osp.train\n.venv/bin/torchrun -m osp.train\n```\n")
    assert [b.split(": ")[-1] for b in bare_venv_programs(sample)] == [
        "'horovodrun' (as .venv/bin/horovodrun)", "'python' (as .venv/bin/python)"]


def test_the_checks_see_the_commands(command_results):
    """The extraction finds what the docs show: every launcher form, and commands that really get parsed
    (a checker that finds nothing would pass every doc)."""
    argvs = [" ".join(argv) for _, _, argv, _ in command_results]
    for form in ("python -m osp.train", "torchrun", "horovodrun", "mpirun", "bench/"):
        assert any(form in a for a in argvs), f"no command with {form!r} found in the docs"
    parsed = [r for r in command_results if r[3][0] == "ok"]
    assert len(parsed) >= 20, f"only {len(parsed)} command lines were parsed"


SAMPLE = """# Title

## Step `make demo` — and *more*

Run `make demo` or `python -m osp.report A.json B.json ...`, not `torchrun --max-restarts` or `python`.

```
horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python -m osp.train --sync osp \\
    --critical auto          # a comment
cat > x.sh <<'SH'
python not/a/command.py
SH
OSP_EXIT_RUNS=3 .venv/bin/python -m pytest -q tests/test_exit.py && make lint
```

```python
python = "not a command"
```

See [the top](#title), [here](#step-make-demo--and-more) and ![plot](bench/results/x.png "t").
"""


def test_the_parsers_follow_markdown_and_shell():
    doc = parse_markdown(ROOT / "docs" / "sample.md", SAMPLE)
    assert anchors(doc) == {"title", "step-make-demo--and-more"}
    assert [t for _, t in links(doc)] == ["#title", "#step-make-demo--and-more", "bench/results/x.png"]
    got = [c.argv for c in commands(doc)]
    assert got == [
        ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", ".venv/bin/python", "-m", "osp.train", "--sync",
         "osp", "--critical", "auto"],
        [".venv/bin/python", "-m", "pytest", "-q", "tests/test_exit.py"],
        ["make", "lint"],
        ["make", "demo"],
        ["make", "demo"],
        ["python", "-m", "osp.report", "A.json", "B.json", "..."],
    ], got
    assert job_for(got[-1])["template"] and not job_for(got[0])["template"]
    assert github_slug("Kernels — `make bench-kernels` (`python bench/kernels.py`)") == \
        "kernels--make-bench-kernels-python-benchkernelspy"
    rules = makefile_rules()
    assert {"test", "demo", "bench-tta", "mutation"} <= set(rules)
    probs, argvs = make_checks(Command("d", 1, "t", ["make", "bench-tta", "BENCH_ARGS=--seeds 0"], {}), rules)
    assert not probs and argvs[0][1] == ["python", "bench/time_to_accuracy.py", "--seeds", "0"]
    assert make_checks(Command("d", 1, "t", ["make", "no-such-target"], {}), rules)[0]


def test_ci_runs_both_tiers_and_each_test_is_in_one():
    """`make test` leaves out the tests marked `jobs` (whole jobs under real launchers) to stay near 20 minutes;
    CI's entry point runs them after it (`make test-jobs`), so no test goes unrun, and the two selections are the
    Makefile's own."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M) and re.search(r"^make test-jobs$", ci, re.M), ci
    make = (ROOT / "Makefile").read_text()
    fast = re.search(r"^test-only:\n\t.*-m \"([^\"]+)\"", make, re.M)
    jobs = re.search(r"^test-jobs: install\n\t.*-m \"([^\"]+)\"", make, re.M)
    assert fast and jobs, "test-only and test-jobs must each select with -m"
    assert (fast.group(1), jobs.group(1)) == ("not bench and not jobs", "jobs and not bench")
