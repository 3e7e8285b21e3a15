"""speedmla.cp.merge_cp_partials over a real torch.distributed group (marker `torch`, skipped
without PyTorch): 2 and 4 processes on the CPU (gloo, a file store: no network), each decoding
its rank's share of one global request set with speedmla.mla_decode (PyTorch CPU tensors: the
CPU reference), all-gathering and merging, against the single-rank call on the global cache."""

import numpy as np
import pytest

import speedmla

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError:
    torch = None

pytestmark = [pytest.mark.torch, pytest.mark.skipif(torch is None, reason="needs PyTorch")]
SCALE = 0.07


def as_bf16(bits):
    return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)


def run_rank(rank, world, store_path, q_len):
    from test_cp_cpu import global_problem, rank_share  # noqa: PLC0415  (the spawned process imports it)

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        q, cache, table, lens = global_problem(np.random.default_rng(5), q_len)  # the same on every rank
        local_cache, local_table, local_lens = rank_share(np.random.default_rng(rank), cache, table, lens, world,
                                                          rank)
        out, lse = speedmla.mla_decode(as_bf16(q), as_bf16(local_cache), torch.from_numpy(local_table),
                                       torch.from_numpy(local_lens), softmax_scale=SCALE, return_lse=True,
                                       causal_seqs=torch.from_numpy(lens), cp_world=world, cp_rank=rank)
        merged, merged_lse = speedmla.cp.merge_cp_partials(out, lse)
        single, single_lse = speedmla.mla_decode(as_bf16(q), as_bf16(cache), torch.from_numpy(table),
                                                 torch.from_numpy(lens), softmax_scale=SCALE, return_lse=True)
        assert merged.dtype == torch.bfloat16 and merged.shape == single.shape
        empty = torch.isneginf(single_lse)
        assert torch.equal(torch.isneginf(merged_lse), empty) and (merged[empty] == 0).all()
        torch.testing.assert_close(merged.float(), single.float(), rtol=1e-2, atol=8e-3)
        torch.testing.assert_close(merged_lse[~empty], single_lse[~empty], rtol=0, atol=2e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_merge_cp_partials_over_a_process_group(tmp_path, world):
    mp.spawn(run_rank, args=(world, str(tmp_path / "store"), 3), nprocs=world, join=True)  # raises a rank's failure
