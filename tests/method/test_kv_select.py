"""Which cached positions a KV prompt keeps (method/kv_select.py), shared by context tuning's demonstrations start
and a KV student's `selected` start: the top n per layer and head or shared, the forced positions always kept, in
order; the gather; the origins; the kept mask. The scorer is checked against the base's own attention weights in
tests/distill/test_kv_start.py."""

import pytest
import torch

from peft_softprompt_plus.method import kv_select


def selected(cache, scores, n, frozen, kept=()):
    forced = sorted(set(range(frozen)) | set(kept))
    return kv_select.gathered(cache, kv_select.per_head_positions(scores, n, forced))


def test_selection_keeps_the_sink_and_the_most_attended_positions_in_order():
    cache = torch.arange(2 * 2 * 3 * 6 * 1, dtype=torch.float32).view(2, 2, 3, 6, 1)  # [layers, 2, Hkv, P, hd]
    scores = torch.tensor([0.0, 5, 1, 9, 2, 8]).expand(2, 3, 6)  # [layers, Hkv, P]
    picked = selected(cache, scores, 3, 1)
    assert torch.equal(picked, cache[:, :, :, [0, 3, 5]])
    assert torch.equal(selected(cache, scores, 2, 0), cache[:, :, :, [3, 5]])
    with pytest.raises(ValueError, match=r"`num_virtual_tokens` must be in \[1, 6\]"):
        selected(cache, scores, 7, 1)


def test_kept_mask_marks_each_head_s_kept_entries_after_the_sink():
    positions = torch.tensor([[[0, 2, 3, 5], [0, 1, 3, 4]]])  # [layers=1, Hkv=2, n=4]
    mask = kv_select.kept_mask(positions, 1, [3, 4])  # [1, 1, 2, 3, 1]
    assert mask.shape == (1, 1, 2, 3, 1)
    assert mask[0, 0, :, :, 0].tolist() == [[False, True, False], [False, True, True]]
    cache = torch.arange(2 * 2 * 1 * 6 * 1, dtype=torch.float32).view(2, 2, 1, 6, 1)  # [layers, 2, Hkv, P, hd]
    scores = torch.tensor([0.0, 5, 1, 0, 2, 8]).expand(2, 1, 6)  # position 3 is the least attended: kept anyway
    assert torch.equal(selected(cache, scores, 3, 1, [3]), cache[:, :, :, [0, 3, 5]])


def test_per_head_positions_differ_per_head_and_shared_ones_follow_the_summed_scores():
    scores = torch.tensor([[[0.0, 5, 1, 9], [7, 0, 5, 1]]])  # [layers=1, Hkv=2, P=4]
    assert kv_select.per_head_positions(scores, 2, [0]).tolist() == [[[0, 3], [0, 2]]]
    assert kv_select.per_head_positions(scores, 2).tolist() == [[[1, 3], [0, 2]]]
    assert kv_select.shared_positions(scores, 2).tolist() == [0, 3]  # summed: 7, 5, 6, 10
    assert kv_select.shared_positions(scores, 2, [1]).tolist() == [1, 3]
    with pytest.raises(ValueError, match=r"`num_virtual_tokens` must be in \[2, 4\].*got 1"):
        kv_select.shared_positions(scores, 1, [0, 1])


def test_gathered_and_origins_agree_for_shared_and_per_head_positions():
    cache = torch.randn(2, 2, 3, 6, 4)  # [layers, 2, Hkv, P, hd]
    shared = torch.tensor([0, 2, 5])
    assert torch.equal(kv_select.gathered(cache, shared), cache[..., [0, 2, 5], :])
    same = kv_select.origins(shared, 2, 3)  # [layers, Hkv, n]
    assert same.shape == (2, 3, 3) and torch.equal(kv_select.gathered(cache, same), cache[..., [0, 2, 5], :])
    per_head = torch.tensor([[[0, 1], [2, 3], [4, 5]], [[5, 4], [3, 2], [1, 0]]]).sort(-1).values
    picked = kv_select.gathered(cache, per_head)  # [layers, 2, Hkv, 2, hd]
    for layer, head, j in [(0, 0, 1), (0, 2, 0), (1, 1, 1)]:
        assert torch.equal(picked[layer, :, head, j], cache[layer, :, head, int(per_head[layer, head, j])])


def test_pooling_ranks_a_much_read_position_s_neighbours_with_it_and_is_checked():
    scores = torch.tensor([[[0.0, 0, 9, 0, 1, 2, 0]]])  # [layers=1, Hkv=1, P=7]: position 2 read most
    assert kv_select.per_head_positions(scores, 3).tolist() == [[[2, 4, 5]]]
    assert kv_select.per_head_positions(scores, 3, pool=3).tolist() == [[[1, 2, 3]]]  # the fact's neighbours
    assert torch.equal(kv_select.pooled(scores, 1), scores)
    assert kv_select.pooled(scores, 3)[0, 0].tolist() == [0.0, 9, 9, 9, 2, 2, 2]
    for bad in (2, 0, True, 1.0):
        with pytest.raises(ValueError, match=r"`width` must be an odd int >= 1"):
            kv_select.pooled(scores, bad)
