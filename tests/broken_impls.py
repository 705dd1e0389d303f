"""Deliberately broken implementations: the suite must catch each of them.

Each takes the contract's signature (``kernels.contract.validate``), so the command line takes it
as ``--impl tests.broken_impls:<name>``, and returns an ``SSDResult`` so its stages are compared
too. Each is the fp32 chunked reference with one bug a kernel could plausibly have.
"""
from __future__ import annotations

from kernels.contract import validate
from oracles.common import SSDResult
from properties.impls import get_impl


def drop_last_partial_chunk(*args, **kwargs) -> SSDResult:
    """A grid of seqlen // chunk_size chunks: the partial last chunk is never computed, so out is 0
    there and final_states is the state entering that chunk. Problems whose seqlen is a multiple
    of chunk_size come out right."""
    problem = validate(*args, **kwargs)
    result = get_impl("reference")(problem)
    full = problem.seqlen // problem.chunk_size * problem.chunk_size
    if full < problem.seqlen:
        result.out[:, full:] = 0
        result.final_states = result.stages["chunk_states"][:, -1].float()
    return result


drop_last_partial_chunk.exposes_stages = True
