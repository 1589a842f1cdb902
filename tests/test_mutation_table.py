"""The mutation table (tests/mutation.py, `make mutation`) stays applicable: every mutant's snippet occurs
exactly once in its file and the mutated file compiles, so a refactor cannot silently retire a mutant."""
import mutation


def test_every_mutant_applies():
    problems = {m.id: why for m in mutation.MUTANTS if (why := mutation.apply(m, mutation.ROOT)) is not None}
    assert not problems, problems
