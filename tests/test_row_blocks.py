"""Cold layouts as plan specs (row_blocks.py): parsing, refusals, and FBGEMM routing bounds."""

import pytest
import torch
from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise
from torchrec.distributed.types import EnumerableShardingSpec, ShardMetadata

from torchrec_hybrid import row_blocks


def _ps(generator, rows=40, cols=64, world=4):
    return generator(torch.empty(rows, cols), world, world, "cpu", None)


def test_row_wise_spec_is_one_slice_of_row_blocks():
    (sl,) = row_blocks.slices_of("t", _ps(row_wise()), 40, 64, 4)
    assert sl == row_blocks.ColumnSlice(0, 64, row_blocks.even_bounds(40, 4))


def test_column_wise_spec_is_slices_each_on_its_owner():
    slices = row_blocks.slices_of("t", _ps(column_wise(ranks=[2, 0])), 40, 64, 4)
    assert [(s.offset, s.width) for s in slices] == [(0, 32), (32, 32)]
    assert slices[0].bounds == [0, 0, 0, 40, 40] and slices[1].bounds == [0, 40, 40, 40, 40]
    assert row_blocks.owners(torch.tensor([0, 39]), torch.tensor(slices[0].bounds)).tolist() == [2, 2]


def test_table_wise_spec_is_one_full_width_slice_on_its_owner():
    """Stock table_wise's spec (one shard of the whole table) is table-wise cold with no row
    elsewhere: how a table with fewer rows than ranks is laid out."""
    (sl,) = row_blocks.slices_of("t", _ps(table_wise(rank=1)), 40, 64, 4)
    assert sl == row_blocks.ColumnSlice(0, 64, [0, 0, 40, 40, 40])
    (sl,) = row_blocks.slices_of("t", _ps(table_wise(rank=3), rows=2), 2, 64, 4)
    assert sl.bounds == [0, 0, 0, 0, 2]


@pytest.mark.parametrize("generator,cols,match", [
    (lambda: column_wise(ranks=[1, 1, 0]), 48, None),  # equal widths may share a rank
    (lambda: row_wise(), 64, "leave ranks \\[3\\] without rows"),  # 3 rows on 4 ranks: an empty block
])
def test_specs_frequency_hybrid_cannot_take_are_refused(generator, cols, match):
    rows = 40 if match is None else 3
    ps = _ps(generator(), rows=rows, cols=cols)
    if match is None:
        assert len(row_blocks.slices_of("t", ps, rows, cols, 4)) == 3
    else:
        with pytest.raises(ValueError, match=match):
            row_blocks.slices_of("t", ps, rows, cols, 4)


def test_slices_not_a_multiple_of_4_wide_are_refused():
    shards = [ShardMetadata([0, 10 * i], [40, 10], f"rank:{i}/cpu") for i in range(3)]
    ps = _ps(row_wise())
    ps.sharding_spec = EnumerableShardingSpec(shards)
    with pytest.raises(ValueError, match="table 't': shard 0 .* multiple of 4"):
        row_blocks.slices_of("t", ps, 40, 30, 4)


def test_slices_of_two_widths_on_one_rank_are_refused():
    shards = [ShardMetadata([0, 0], [40, 32], "rank:1/cpu"), ShardMetadata([0, 32], [40, 16], "rank:1/cpu")]
    ps = _ps(row_wise())
    ps.sharding_spec = EnumerableShardingSpec(shards)
    with pytest.raises(ValueError, match="rank 1 holds column slices of widths 32 and 16"):
        row_blocks.slices_of("t", ps, 40, 48, 4)


def test_column_widths_are_multiples_of_4():
    assert row_blocks.column_widths(64, 4) == [16] * 4
    assert row_blocks.column_widths(64, 3) == [24, 24, 16]
    with pytest.raises(ValueError, match="cannot cut 4 columns in 2 slices"):
        row_blocks.column_widths(4, 2)


@pytest.mark.parametrize("bounds", [[0, 0, 0, 23, 23], [0, 23, 23, 23, 23], [0, 5, 9, 15, 23], [0, 0, 23, 23, 23],
                                    [0, 6, 12, 18, 23], [0, 5, 5, 9, 23]])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_bucketization_sends_every_id_to_its_owner_and_hot_ids_to_bucket_w(bounds, dtype):
    """The input dist's bucketization (row_blocks.bucketize, FBGEMM's) decodes
    row_blocks.bucket_ids: each cold id to its owner's bucket and its row there, whatever the
    blocks (empty, uneven, one owner), and each hot lookup to bucket W as its replica row."""
    world, rows = len(bounds) - 1, bounds[-1]
    b = torch.tensor(bounds)
    owner = row_blocks.owners(torch.arange(rows), b)
    replica_rows = torch.tensor([0, 3, 40, 7, 2 * rows])
    ids = torch.cat([row_blocks.bucket_ids(torch.arange(rows) - b[owner], owner, world),
                     row_blocks.bucket_ids(replica_rows, world, world)]).to(dtype)
    lengths, rows_out, _ = row_blocks.bucketize(torch.tensor([ids.numel()]), ids, world)
    assert lengths.tolist() == torch.bincount(owner, minlength=world).tolist() + [replica_rows.numel()]
    assert rows_out[:rows].tolist() == (torch.sort(owner, stable=True).indices - b[owner.sort(stable=True).values]
                                        ).tolist()
    assert rows_out[rows:].tolist() == replica_rows.tolist()


@pytest.mark.parametrize("rows,world", [(6, 4), (9, 4), (10, 8)])
def test_hand_written_row_wise_cold_gives_every_rank_a_row(rows, world):
    """``frequency_hybrid()`` on a table of at least W rows whose stock ceil blocks would leave a rank
    none (6 rows on 4 ranks: 2, 2, 2, 0) writes blocks of ``rows // W`` or one more, which sharding
    takes; where stock's blocks are fine, it keeps them."""
    from torchrec_hybrid import frequency_hybrid

    (sl,) = row_blocks.slices_of("t", _ps(frequency_hybrid(), rows=rows, cols=16, world=world), rows, 16, world)
    assert sl.bounds == row_blocks.even_bounds(rows, world) and sl.bounds[-1] == rows
    assert min(b - a for a, b in zip(sl.bounds, sl.bounds[1:])) >= 1
    (sl,) = row_blocks.slices_of("t", _ps(frequency_hybrid()), 40, 64, 4)
    assert sl.bounds == row_blocks.stock_bounds(40, 4) == [0, 10, 20, 30, 40]
