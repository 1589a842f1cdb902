"""The CUDA kernels' launch shapes (csrc/launch.h), checked on the CPU: the same host arithmetic the
.cu files launch with, exposed as torch.ops.osp.launch_shape / launch_items / launch_cover on every
build. Block counts are the host's for any block size, every element of every block is visited exactly
once by the (block, chunk) items and the threads that run them, big blocks spread over many CTAs,
small ones share a CTA, and nothing overflows for sizes up to 2**40."""
import pytest
import torch

from osp import ops

assert ops.HAS_EXTENSION, "osp._C did not build; these tests check the compiled launch arithmetic"

FIELDS = ("rows", "span", "chunk", "chunks", "items", "ctas", "grid", "group", "per_cta")
THREADS, CHUNK, MAX_GRID = 256, 4096, 2**20
HUGE = 2**63 - 1


def shape(n, bs):
    """(pass 1, workspace, pass 2) of score_blocks' plan; pass 1 is every block kernel's shape."""
    v = torch.ops.osp.launch_shape(n, bs)
    assert len(v) == 2 * len(FIELDS) + 1
    return dict(zip(FIELDS, v[:9])), v[9], dict(zip(FIELDS, v[10:]))


def items(n, bs, first, count):
    return torch.ops.osp.launch_items(n, bs, first, count).tolist()


def check_invariants(s, span):
    """What any shape must satisfy, by formula (exact Python ints: a wrapped int64 shows as a mismatch)."""
    assert all(v >= 0 for v in s.values()), s
    if s["rows"] == 0:
        assert s["items"] == s["ctas"] == s["grid"] == 0, s
        return
    assert s["span"] == span
    g = s["group"]
    assert 1 <= g <= THREADS and g & (g - 1) == 0 and g * s["per_cta"] == THREADS, s
    assert s["chunks"] * s["chunk"] >= span > (s["chunks"] - 1) * s["chunk"], s
    assert s["chunks"] == 1 or (s["chunk"] == CHUNK and g == THREADS), s
    assert s["items"] == s["rows"] * s["chunks"], s
    assert s["ctas"] * s["per_cta"] >= s["items"] > (s["ctas"] - 1) * s["per_cta"], s
    assert s["grid"] == min(s["ctas"], MAX_GRID) >= 1, s
    # every thread's share of an item stays small: kPerThread elements in a full chunk
    assert s["chunks"] > 1 or -(-s["chunk"] // g) <= 16 or g == THREADS, s


def check_tiling(rows, n, bs, whole):
    """Consecutive items tile the flat range: each starts where the previous ended, inside its block."""
    prev = None
    for b, c, lo, hi in rows:
        start, end = b * bs, min(n, (b + 1) * bs) if b * bs < n else None
        assert end is not None, (b, "a block past the end")
        assert start <= lo <= hi <= end, (b, c, lo, hi)
        if prev is not None:
            assert lo == prev[3] and (b, c) > prev[:2], (prev, (b, c, lo, hi))
        prev = (b, c, lo, hi)
    if whole and rows:
        assert rows[0][2] == 0 and rows[-1][3] == n


SMALL_N = [0, 1, 2, 5, 31, 32, 33, 255, 4095, 4096, 4097, 3 * 4096 + 1, 10007]
SMALL_BS = [1, 2, 3, 7, 16, 17, 31, 32, 33, 100, 257, 2048, 2049, 4096, 4097, 10000, 2**40, HUGE]


@pytest.mark.parametrize("n", SMALL_N)
def test_every_element_is_visited_once(n):
    """Exhaustively, by simulating every CTA of the grid, every thread's slot and lane (launch_cover):
    each element of the flat tensor exactly once, and for a two-pass score each partial exactly once."""
    for bs in SMALL_BS:
        s, workspace, r = shape(n, bs)
        assert s["rows"] == ops.num_blocks(n, bs), (n, bs)
        check_invariants(s, min(n, bs))
        hits = torch.ops.osp.launch_cover(n, bs)
        assert hits.shape == (n,) and bool((hits == 1).all()), (n, bs, hits.unique())
        rows = items(n, bs, 0, s["items"])
        assert len(rows) == s["items"]
        check_tiling(rows, n, bs, whole=True)
        if s["chunks"] > 1:
            assert workspace == s["items"] and r["rows"] == s["rows"] and r["span"] == s["chunks"], (n, bs)
            assert r["chunks"] == 1
            check_invariants(r, s["chunks"])
            partials = torch.ops.osp.launch_cover(n, bs, True)
            assert partials.shape == (workspace,) and bool((partials == 1).all()), (n, bs)
        else:
            assert workspace == 0 and r["items"] == 0, (n, bs)


@pytest.mark.parametrize("n,bs", [(0, 1), (0, HUGE), (1, 1), (1, HUGE), (10, HUGE), (97, 2**62), (2**40, HUGE),
                                  (2**40, 2**62 + 1), (2**40 + 1, 2**40), (2**40, 2**40 - 1), (2**40, 1),
                                  (2**40 + 3, 7), (37 * 32 + 5, 32), (2**40, 4097), (2**40, 2**20 + 1)])
def test_block_count_is_the_hosts(n, bs):
    """The kernels get the host's block count (ceil without the n + bs - 1 that wraps): one block for a
    huge block size, none for n = 0; by formula for sizes too big to visit."""
    s, workspace, r = shape(n, bs)
    nb = ops.num_blocks(n, bs)
    assert s["rows"] == nb
    check_invariants(s, min(n, bs))
    if nb == 0:
        assert items(n, bs, 0, 10) == []
        return
    # the first and last items, and those around a block boundary in the middle, tile their range
    check_tiling(items(n, bs, 0, 3), n, bs, whole=False)
    last = items(n, bs, max(0, s["items"] - 3), 3)
    assert last[-1][3] == n and last[-1][0] == nb - 1
    check_tiling(last, n, bs, whole=False)
    assert items(n, bs, 0, 1)[0][2] == 0
    mid = (nb // 2) * s["chunks"]
    around = items(n, bs, max(0, mid - 2), 4)
    check_tiling(around, n, bs, whole=False)
    if s["chunks"] > 1:
        check_invariants(r, s["chunks"])
        assert workspace == s["items"] and r["rows"] == nb


def test_a_single_huge_block_spreads_over_many_ctas():
    """block_size=None makes a whole flat group one block: its chunks are separate CTAs."""
    for n, bs in ((100_000_000, 100_000_000), (100_000_000, HUGE), (400 * 2**20 // 2, 2**30)):
        s, workspace, r = shape(n, bs)
        assert s["rows"] == 1 and s["ctas"] == -(-n // CHUNK) > 1 and s["grid"] == s["ctas"], (n, bs, s)
        # the score's second pass folds the block's partials: one item, a whole CTA striding over them
        assert workspace == s["ctas"] and r["rows"] == 1 and r["group"] == THREADS


def test_small_blocks_share_a_cta():
    """A thread group per block, as small as the block allows: bs=1 is a thread per block."""
    n = 1_000_003
    for bs, group in ((1, 1), (2, 1), (16, 1), (17, 2), (32, 2), (33, 4), (100, 8), (512, 32), (1000, 64),
                      (2048, 128), (4096, 256), (4097, 256)):
        s, _, _ = shape(n, bs)
        assert s["group"] == group and s["per_cta"] == THREADS // group, (bs, s)
        assert s["chunks"] == (1 if bs <= CHUNK else 2), (bs, s)
        assert s["ctas"] == -(-s["items"] // s["per_cta"]), (bs, s)


def test_no_overflow_up_to_2_to_the_40():
    """Every count stays a positive int64 for n up to 2**40 and any block size, the grid stays capped,
    and the work items never outnumber the elements by more than a block's worth each."""
    for n in (2**40, 2**40 - 1, 2**39 + 12345):
        for bs in (1, 3, 4096, 4097, 2**31 + 1, 2**40, HUGE):
            s, workspace, r = shape(n, bs)
            check_invariants(s, min(n, bs))
            assert s["items"] <= n and s["grid"] <= MAX_GRID, (n, bs, s)
            if workspace:
                check_invariants(r, s["chunks"])
            last = items(n, bs, s["items"] - 1, 1)[0]
            assert last[0] == ops.num_blocks(n, bs) - 1 and last[3] == n


def test_bad_arguments_are_refused():
    with pytest.raises(RuntimeError, match="block_size must be a positive integer, got 0"):
        torch.ops.osp.launch_shape(10, 0)
    with pytest.raises(RuntimeError, match="n >= 0"):
        torch.ops.osp.launch_shape(-1, 4)
    with pytest.raises(RuntimeError, match="n must be in"):
        torch.ops.osp.launch_cover(2**30, 4)
