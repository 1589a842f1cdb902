"""The feature registry (tests/features.py) is complete: every public keyword and method of
``osp.DistributedOptimizer`` and every name of ``osp.__all__`` has a row, and every row reaches the generated
tables (a value of their feature axis, loop patterns they cross) or names tests that exist. A new option or
method without a row fails here, so it cannot skip the tables."""
import inspect
import os

import conformance as C
import features as FE

import osp

HERE = os.path.dirname(os.path.abspath(__file__))


def public_names():
    keywords = [n for n in inspect.signature(osp.DistributedOptimizer.__init__).parameters
                if n not in ("self", "optimizer")]
    members = [n for klass in osp.DistributedOptimizer.__mro__ if klass.__module__.startswith("osp")
               for n in vars(klass) if not n.startswith("_")]
    return set(keywords) | set(members) | (set(osp.__all__) - {"__version__"})


def test_every_public_name_has_a_row():
    covered = {n for f in FE.FEATURES.values() for n in f.covers}
    missing = sorted(public_names() - covered)
    assert not missing, (f"public names of osp without a row in tests/features.py: {missing}; add a Feature that "
                         "covers each (crossed in the tables, or the patterns or tests that exercise it)")
    stale = sorted(covered - public_names())
    assert not stale, f"rows cover names osp no longer has: {stale}"


def test_every_row_reaches_the_tables_or_named_tests():
    for f in FE.FEATURES.values():
        assert f.crossed or f.patterns or f.tests, f"{f.name}: neither crossed, nor patterns, nor tests"
        for p in f.patterns:
            assert p in C.PATTERNS, f"{f.name}: pattern {p!r} is not in conformance.PATTERNS"
        for t in f.tests:
            path, _, name = t.partition("::")
            assert os.path.exists(os.path.join(HERE, os.pardir, path)), f"{f.name}: {path} does not exist"
            if name:
                src = open(os.path.join(HERE, os.pardir, path)).read()
                assert f"def {name}(" in src, f"{f.name}: {path} has no test {name}"
        for mode in f.refused:
            assert mode in C.MODES or any(m.split("-")[0] == mode for m in C.MODES), f"{f.name}: no mode {mode!r}"


def test_the_axis_is_crossed_with_every_mode_pattern_optimizer_and_dtype():
    rows = C.pairwise_cases()
    for table, key in ((C.MODES, "mode"), (C.PATTERNS, "pattern"), (C.OPTIMIZERS, "optimizer"), (C.DTYPES, "dtype")):
        for feature in FE.AXIS:
            seen = {getattr(c, key) for c in rows if c.feature == feature}
            assert seen == set(table), f"{feature} x {key}: {sorted(set(table) - seen)} never crossed"
    every_mode = {(c.mode, c.feature) for c in C.mode_feature_cases()}
    assert every_mode == {(m, f) for m in C.MODES for f in FE.AXIS if f != "none"}


def test_a_refusal_is_a_case_outcome_not_a_skip(one_rank):
    """A refused combination is run and must raise its documented error (the oracle can fail on it)."""
    case = C.Case("osp-0.25", "plain", "sgd-momentum", "fp32", "none", "predivide-4")
    out = C.run_case(case)
    assert out.kind == "refused" and C.verdict(case, out) is None, out
    allowed = C.Case("bsp", "plain", "sgd-momentum", "fp32", "none", "predivide-4")
    out = C.run_case(allowed)
    assert out.kind in ("bitwise", "ulp") and C.verdict(allowed, out) is None, out
