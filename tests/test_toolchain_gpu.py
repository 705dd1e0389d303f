"""What the cuTile toolchain gets wrong, pinned where a kernel author would meet it.

tileiras 13.4.92 (cuda-tile 1.7.0) on sm_90: a loop that carries two loaded tiles into the next
iteration (each loaded a step ahead, ``next = ct.load(...)`` at step t, used at step t + 1) gets one
of them wrong: the tile it stores holds the iteration's own load, not the carried one (y_t = 2
x_(t+1)), while the tile that feeds the MMA comes out right. The same loop loading both in its own
step is right, and in the walk of out either tile carried alone was (prefetch_x 1 and 2 in the
record). Found with the walk of out's x a step ahead (session 89's H100 note in the README, branch
exp/walk-prefetch-x, reports/h100/experiments/carried_tiles_<commit>.txt). The Tile IR cuTile writes
for this kernel carries the two values correctly, so the fault is tileiras'. Of the project's
kernels only the state passing (kernels/fwd_pass_state.py) carries loaded tiles, a chunk's weight
and increment, both used elementwise, and its chunk states and outputs are checked against float64
in tests/test_kernels_gpu.py. A strict xfail: a toolchain that fixes the fault fails this test, the
sign that the pattern is safe again.
"""
from __future__ import annotations

import cuda.tile as ct
import pytest
import torch

HAS_GPU = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
Q, P, N = 64, 64, 128
STEPS, HEADS = 64, 8


ZERO = ct.PaddingMode.ZERO


@ct.function
def x_columns(x, step, head, ORDERED: ct.Constant[bool]):
    """x_t^T (P, Q): read in transposed order (ORDERED) or loaded and transposed."""
    if ORDERED:
        t = ct.load(x, (0, 0, head, step), shape=(1, P, 1, Q), order=(0, 3, 2, 1),
                    padding_mode=ZERO).reshape((P, Q))
    else:
        t = ct.load(x, (0, step, head, 0), shape=(1, Q, 1, P),
                    padding_mode=ZERO).reshape((Q, P)).transpose()
    return t


@ct.kernel
def carried_tiles_walk(x, B, h_out, y_out, nsteps, ORDERED: ct.Constant[bool],
                       AHEAD: ct.Constant[bool]):
    """h <- h / 2 + x_t^T B_t over the steps t of x (1, nsteps Q, heads, P) bf16, a block a head,
    and y_t = 2 x_t from a second, plain load of x_t. AHEAD: both of x's tiles loaded a step
    ahead and carried into the next iteration."""
    head = ct.bid(0)
    h = ct.zeros((P, N), dtype=ct.float32)
    if AHEAD:
        next_columns = x_columns(x, 0, head, ORDERED)
        next_rows = ct.load(x, (0, 0, head, 0), shape=(1, Q, 1, P), padding_mode=ZERO)
    for step in range(nsteps):
        if AHEAD:
            following = ct.minimum(step + 1, nsteps - 1)
            columns, rows = next_columns, next_rows
            next_columns = x_columns(x, following, head, ORDERED)
            next_rows = ct.load(x, (0, following, head, 0), shape=(1, Q, 1, P),
                                padding_mode=ZERO)
        else:
            columns = x_columns(x, step, head, ORDERED)
            rows = ct.load(x, (0, step, head, 0), shape=(1, Q, 1, P), padding_mode=ZERO)
        B_t = ct.load(B, (0, step, 0, 0), shape=(1, Q, 1, N), padding_mode=ZERO).reshape((Q, N))
        h = ct.mma(columns, B_t, h * 0.5)
        ct.store(y_out, (0, step, head, 0), (rows.astype(ct.float32) * 2.0).astype(ct.bfloat16))
    ct.store(h_out, (head, 0, 0), h.reshape((1, P, N)))


MISCOMPILED = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "tileiras 13.4.92: with two loaded tiles carried across the iteration the stored one is the "
    "iteration's own load (y_t = 2 x_(t+1)); module docstring"))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("ordered", [False, True], ids=["transposed", "ordered"])
@pytest.mark.parametrize("ahead", [False, pytest.param(True, marks=MISCOMPILED)],
                         ids=["own-step", "a-step-ahead"])
def test_two_tiles_carried_across_a_loop_iteration_keep_their_values(ahead, ordered):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, STEPS * Q, HEADS, P, generator=g, device="cuda").bfloat16()
    B = torch.randn(1, STEPS * Q, 1, N, generator=g, device="cuda").bfloat16()
    h = torch.empty(HEADS, P, N, device="cuda")
    y = torch.zeros_like(x)
    ct.launch(torch.cuda.current_stream(), (HEADS,), carried_tiles_walk,
              (x, B, h, y, STEPS, ordered, ahead))
    expected = torch.zeros(HEADS, P, N, dtype=torch.float64, device="cuda")
    for t, (x_t, B_t) in enumerate(zip(x.double().view(STEPS, Q, HEADS, P),
                                       B.double().view(STEPS, Q, N))):
        expected = expected / 2 + torch.einsum("qhp,qn->hpn", x_t, B_t)
    # The MMA's operands are exact in bf16 and it accumulates in float32: 1e-6 of the largest.
    assert (h.double() - expected).abs().max() <= 1e-6 * expected.abs().max()
    wrong = [t for t, (y_t, x_t) in enumerate(zip(y.view(STEPS, Q, HEADS, P),
                                                    x.view(STEPS, Q, HEADS, P)))
             if not torch.equal(y_t, 2 * x_t)]
    assert not wrong, f"y_t != 2 x_t at {len(wrong)} of {STEPS} steps, the first {wrong[:4]}"
