"""Horovod 0.28.1's test_torch.py against osp.horovod: every TorchTests test run on 2 ranks under torchrun
(tests/workers/hvd_upstream_runner.py), then docs/horovod-tests.md written from the result, and the result compared
with expected.json (what tests/test_horovod_upstream.py holds `make test` to).

    python tests/third_party/horovod/table.py                  # run all (a few minutes), write the doc, compare
    python tests/third_party/horovod/table.py --results R.json # from a run's results.json instead
    ... --write-expected                                       # also rewrite expected.json from this run

Exit status 1 when an expected pass or refusal did not happen (tests that now do better are listed, not failed).
`make horovod-upstream` runs the first line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
import hvd_upstream_runner as runner  # noqa: E402

EXPECTED = os.path.join(HERE, "expected.json")
DOC = os.path.join(ROOT, "docs", "horovod-tests.md")
COMMAND = "`make horovod-upstream` (which runs `python tests/third_party/horovod/table.py`)"
CLASSES = ("passed", "skipped", "refused", "failed")

# Why, where the measured outcome needs more than its exception to read: test -> (the class it explains, why).
# A note is shown only while the test still has that class.
_SHAPES = ("the ranks' tensors differ in shape: Horovod's coordinator compares every rank's request and raises on "
           "all ranks; osp.horovod does not compare them across ranks, and Gloo aborts the process on the size "
           "mismatch (a C++ abort, not an exception)")
_META = ("the ranks' {what} differ: Horovod's coordinator raises on every rank; osp.horovod does not compare them "
         "across ranks, so the collective runs on bytes that happen to fit and nothing is raised")
_NAMES = ("collectives are matched by their order on every rank, not by name (ops.py: \"Order, not names\"): the "
          "test has rank 0 start a collective that rank 1 starts only after a barrier, which Horovod's coordinator "
          "matches by name; here the ranks' checks see an allreduce against a barrier and raise "
          "CollectiveMismatchError on both (a departure, docs/horovod.md)")
_JOIN = ("hvd.join() takes part in the DistributedOptimizer's steps only (functions.join's docstring); here the "
         "other rank runs plain {op}s, which the joined rank cannot answer: CollectiveMismatchError on both ranks "
         "(a departure, docs/horovod.md)")
_REPLICAS = ("the test steps models that differ between the ranks (no broadcast first; torch seeds each process "
             "apart): Horovod averages the gradients anyway, osp.DistributedOptimizer's check_replicas refuses")
_GROUPED_RS = ("hvd.grouped_reducescatter is not defined (AttributeError): reducescatter itself is refused with "
               "a message, its grouped form is missing")
NOTES = {
    "test_horovod_allreduce_error": ("failed", _SHAPES),
    "test_horovod_allgather_error": ("failed", _SHAPES),
    "test_horovod_alltoall_rank_error": ("failed", _SHAPES.replace("tensors differ in shape", "splits differ")),
    "test_horovod_allreduce_type_error": ("failed", _META.format(what="dtypes")),
    "test_horovod_allgather_type_error": ("failed", _META.format(what="dtypes")),
    "test_horovod_broadcast_type_error": ("failed", _META.format(what="dtypes")),
    "test_horovod_alltoall_type_error": ("failed", _META.format(what="dtypes")),
    "test_horovod_broadcast_error": ("failed", _META.format(what="shapes (the root's is the smaller)")),
    "test_horovod_broadcast_rank_error": ("failed", "the ranks name different roots: Horovod raises on every rank; "
                                                    "here each rank broadcasts from its own root and they time out"),
    "test_horovod_allreduce_duplicate_name_error": ("failed", _NAMES),
    "test_horovod_allgather_duplicate_name_error": ("failed", _NAMES),
    "test_horovod_broadcast_duplicate_name_error": ("failed", _NAMES),
    "test_horovod_reducescatter_duplicate_name_error": ("failed", "hvd.reducescatter_async is not defined "
                                                                  "(AttributeError); reducescatter is refused"),
    "test_horovod_reducescatter_async_fused": ("failed", "hvd.reducescatter_async is not defined (AttributeError); "
                                                         "reducescatter is refused"),
    "test_horovod_join_allreduce": ("failed", _JOIN.format(op="allreduce")),
    "test_horovod_join_allgather": ("failed", _JOIN.format(op="allgather")),
    "test_horovod_join_broadcast": ("failed", _JOIN.format(op="broadcast")),
    "test_broadcast_state": ("refused", _REPLICAS + "; Horovod 0.28.1 itself, on this torch, fails it later, on "
                                        "torch.optim.Muon (2-D parameters only)"),
    "test_broadcast_state_options": ("refused", _REPLICAS),
    "test_dynamic_requires_grad": ("refused", _REPLICAS + "; Horovod 0.28.1 itself passes it"),
    "test_no_named_parameters": ("refused", _REPLICAS + "; Horovod 0.28.1 itself passes it"),
    "test_force_allreduce": ("failed", "the test builds every torch.optim optimizer; torch 2.13's Muon takes 2-D "
                                       "parameters only: fails the same with Horovod 0.28.1 itself (not osp.horovod)"),
    "test_sparse_embeddings": ("refused", "the test wraps torch.optim.SparseAdam (sparse gradients; with and "
                                          "without sparse_as_dense): osp's optimizer averages dense gradients in "
                                          "flat buffers and refuses it"),
    "test_async_sparse_allreduce": ("refused", "Horovod's sparse allreduce (an allgather of indices and values)"),
    "test_async_sparse_allreduce_process_sets": ("refused", "Horovod's sparse allreduce, on process sets"),
    **{f"test_horovod_grouped_reducescatter{s}": ("failed", _GROUPED_RS)
       for s in ("", "_average", "_prescale", "_postscale", "_scalar_error", "_process_sets", "_grad")},
}


def load_expected() -> dict:
    with open(EXPECTED) as f:
        return json.load(f)


def expected_from(results: dict) -> dict:
    """What a run measured, as expected.json holds it: each test's class, and for a refusal the pattern of its
    message (the message up to its first digit or quote: stable, and specific)."""
    tests = {}
    for name, t in results["tests"].items():
        entry = {"class": t["class"]}
        if t["class"] == "refused":
            head = re.split(r"[0-9'\"(]", t["reason"], maxsplit=1)[0].strip()
            if len(head) > 100:
                head = head[:100].rsplit(" ", 1)[0]
            entry["pattern"] = re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", head)
        elif t["class"] in ("skipped", "failed"):
            entry["reason"] = t["reason"][:300]
        tests[name] = entry
    return {"_about": "Measured outcomes of Horovod 0.28.1's test_torch.py against osp.horovod on 2 ranks (CPU), "
                      "written by tests/third_party/horovod/table.py --write-expected; tests/test_horovod_upstream.py "
                      "holds the passed and refused ones to it.",
            "measured": {"date": datetime.date.today().isoformat(), "devices": results.get("devices"),
                         "seconds": results["seconds"]},
            "tests": tests}


def compare(results: dict, expected: dict) -> tuple:
    """(regressions, improvements): tests expected to pass (or be refused with their pattern) that did not; tests
    that now do better than expected."""
    worse, better = [], []
    for name, want in expected["tests"].items():
        got = results["tests"].get(name)
        if got is None:
            continue
        if want["class"] == "passed" and got["class"] != "passed":
            worse.append(f"{name}: expected passed, got {got['class']}: {got['reason']}")
        elif want["class"] == "refused":
            if got["class"] == "passed":
                better.append(f"{name}: expected refused, now passes")
            elif got["class"] != "refused" or not re.search(want["pattern"], got["reason"]):
                worse.append(f"{name}: expected refused /{want['pattern']}/, got {got['class']}: {got['reason']}")
        elif want["class"] in ("failed", "skipped") and got["class"] in ("passed", "refused") \
                and got["class"] != want["class"]:
            better.append(f"{name}: expected {want['class']}, now {got['class']}")
    return worse, better


def _cell(text: str, limit: int = 240) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return text.replace("|", "\\|").replace("*", "\\*").replace("_", "\\_").replace("<", "&lt;")


def markdown(results: dict) -> str:
    counts = {c: sum(t["class"] == c for t in results["tests"].values()) for c in CLASSES}
    lines = [
        "# Horovod's own PyTorch tests against osp.horovod",
        "",
        "<!-- generated by tests/third_party/horovod/table.py: do not edit by hand -->",
        "",
        "Horovod 0.28.1's `test/parallel/test_torch.py` (vendored unmodified in `tests/third_party/horovod/`), every "
        "`TorchTests` test, with `import horovod.torch as hvd` resolving to `osp.horovod` (no Horovod imported), on "
        f"{results['nproc']} ranks under torchrun, Gloo; {results.get('devices') or ''}. The runner "
        "(`tests/workers/hvd_upstream_runner.py`) gives each rank the environment `horovodrun --gloo` would "
        "(`HOROVOD_RANK`, `HOROVOD_SIZE`), runs the tests one at a time in the file's order, and after each test "
        "compares the ranks' outcomes; where they are not all passed (or all skipped), the process group is made "
        "again before the next test. A rank that crashed is started again from the next test.",
        "",
        f"Produced by {COMMAND} in {results['seconds']:.0f} s ({len(results['launches'])} torchrun launches: a "
        "rank that crashed is started again from the next test).",
        "",
        f"**{len(results['tests'])} tests: {counts['passed']} passed, {counts['skipped']} skipped, "
        f"{counts['refused']} refused, {counts['failed']} failed.**",
        "",
        "- *passed*: passed on every rank.",
        "- *skipped*: skipped by the test itself on every rank (no GPU here, MPI only, `@pytest.mark.skip`).",
        "- *refused*: osp says it does not do this, on purpose (a part of Horovod osp.horovod does not provide, or an "
        "osp check), with the message shown; or the test expects an error and passes only on that refusal.",
        "- *failed*: anything else; the exception's first line on the first rank that failed, and why where known.",
        "",
        "`make test` holds every *passed* and *refused* test here to its outcome (`tests/test_horovod_upstream.py`, "
        "`tests/third_party/horovod/expected.json`).",
        "",
        "| # | test | outcome | what the run said (first rank that failed) | why |",
        "|---|---|---|---|---|",
    ]
    for i, name in enumerate(results["order"], 1):
        t = results["tests"][name]
        note = NOTES.get(name)
        why = note[1] if note is not None and note[0] == t["class"] else ""
        secs = max((o or {}).get("seconds") or 0 for o in t["ranks"])
        said = _cell(t["reason"]) + (f" ({secs:.0f} s)" if secs >= 3 else "")
        lines.append(f"| {i} | `{name}` | {t['class']} | {said} | {_cell(why, 600)} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", help="a results.json of hvd_upstream_runner --drive (default: run the tests now)")
    p.add_argument("--out", default=os.path.join(ROOT, "build", "horovod-upstream"), help="where the run writes")
    p.add_argument("--doc", default=DOC)
    p.add_argument("--write-expected", action="store_true", help="rewrite expected.json from this run")
    args = p.parse_args(argv)
    if args.results:
        with open(args.results) as f:
            results = json.load(f)
    else:
        # CPU only, as expected.json was measured
        results = runner.drive(args.out, env={"CUDA_VISIBLE_DEVICES": ""})
    print(runner.summary(results))
    if results["horovod_modules"]:
        print(f"a real Horovod was imported: {results['horovod_modules']}")
        return 1
    with open(args.doc, "w") as f:
        f.write(markdown(results))
    print(f"wrote {os.path.relpath(args.doc, ROOT)}")
    if args.write_expected:
        with open(EXPECTED, "w") as f:
            json.dump(expected_from(results), f, indent=1)
            f.write("\n")
        print(f"wrote {os.path.relpath(EXPECTED, ROOT)}")
        return 0
    worse, better = compare(results, load_expected())
    for line in better:
        print("better than expected.json:", line)
    for line in worse:
        print("WORSE than expected.json:", line)
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
