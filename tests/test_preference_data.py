"""--preference-data read back: pairs of any lengths against the sequence length, the files checked (the loss
masks of --sft-data too), pairs that train nothing counted."""

from __future__ import annotations

import numpy as np
import pytest

from llamatron.data.indexed import IndexedDatasetWriter
from llamatron.data.preference import response_prefix
from llamatron.data.preference_dataset import build_preference_datasets
from llamatron.data.sft import mask_prefix
from llamatron.data.sft_dataset import build_sft_datasets
from llamatron.errors import DataError


def write_pairs(prefix: str, pairs: list[tuple[int, int, int]], mask_values=(0, 1)) -> dict:
    """Pairs of (prompt, chosen reply, rejected reply) lengths, random tokens, the mask on the replies (written
    with `mask_values` for untrained, trained); returns the arrays written, by response."""
    rng = np.random.default_rng(0)
    written: dict[str, list] = {"chosen": [], "rejected": []}
    writers = {}
    for response in written:
        writers[response] = IndexedDatasetWriter(response_prefix(prefix, response), np.uint16)
        writers[response + "_mask"] = IndexedDatasetWriter(mask_prefix(response_prefix(prefix, response)), np.uint8)
    for prompt, *replies in pairs:
        head = rng.integers(3, 256, prompt)
        for response, reply in zip(written, replies):
            tokens = np.concatenate([head, rng.integers(3, 256, reply)])
            mask = np.r_[np.full(prompt, mask_values[0]), np.full(reply, mask_values[1])].astype(np.uint8)
            writers[response].add_document(tokens)
            writers[response + "_mask"].add_document(mask)
            written[response].append((tokens, mask != mask_values[0]))
    for writer in writers.values():
        writer.finalize()
    return written


def test_pairs_of_any_length_up_to_the_sequence_train(tmp_path):
    """--seq-length 64 (65 tokens a sample): a long chosen reply beside a short rejected one, both shorter, one
    exactly 65, and one whose long response loses every trained token to the cut (left out). Was an IndexError
    reading the short response's mask past its end."""
    lengths = [(10, 80, 5), (10, 5, 80), (8, 4, 3), (20, 45, 2), (70, 5, 1), (3, 2, 2)]
    written = write_pairs(str(tmp_path / "p"), lengths)
    train, _ = build_preference_datasets(str(tmp_path / "p"), "100,0,0", 64, 12, 0, seed=0)
    assert sorted(train.records.tolist()) == [0, 1, 2, 3, 5] and train.dropped == 1
    for index in range(10):  # each sample the record written, cut at 65 and padded with 0
        record, response = int(train.order[index // 2]), ("chosen", "rejected")[index % 2]
        tokens, mask = written[response][record]
        want = np.zeros(65, dtype=np.int64)
        want[: min(65, tokens.size)] = tokens[:65]
        trained = np.zeros(65, dtype=bool)
        trained[1 : min(65, mask.size)] = mask[1:65]
        sample = train[index]
        assert (sample["tokens"] == want).all() and (sample["loss_mask"] == trained).all(), (record, response)


@pytest.mark.parametrize("values", [(0, 7), (2, 1)], ids=["token-ids", "untrained-2"])
def test_a_mask_of_other_values_than_0_and_1_is_refused_naming_the_file(tmp_path, values):
    """A mask file holding token ids trained every non-zero position silently; refused, the file named."""
    write_pairs(str(tmp_path / "p"), [(4, 3, 3), (5, 2, 4)], mask_values=values)
    with pytest.raises(DataError) as err:
        build_preference_datasets(str(tmp_path / "p"), "100,0,0", 64, 4, 0, seed=0)
    message = str(err.value)
    assert message.startswith(f"{tmp_path}/p_chosen_mask.bin: a loss mask holds only 0 and 1, but this file holds"), (
        message
    )
    assert f"the value {max(values)} " in message and "preprocess --preference" in message


def test_an_sft_mask_of_token_ids_is_refused(tmp_path):
    prefix = str(tmp_path / "c")
    tokens, mask = IndexedDatasetWriter(prefix, np.uint16), IndexedDatasetWriter(mask_prefix(prefix), np.uint16)
    for ids in ([5, 6, 7, 8], [9, 10, 11]):
        tokens.add_document(ids)
        mask.add_document(ids)  # the tokens written again as the mask
    tokens.finalize(), mask.finalize()
    with pytest.raises(
        DataError, match=r"c_mask.bin: a loss mask holds only 0 and 1, but this file holds the value 11 "
    ):
        build_sft_datasets(prefix, "100,0,0", 16, 4, 0, seed=0)


def test_pairs_whose_chosen_equals_rejected_are_counted_in_one_warning(tmp_path):
    """They train nothing (DPO's gradient is 0 for them): alike outright, alike within the 33 tokens of
    --seq-length 32 (they differ after the cut); not alike: other tokens, or the same tokens with another mask."""
    prefix = str(tmp_path / "p")
    writers = {}
    for response in ("chosen", "rejected"):
        writers[response] = IndexedDatasetWriter(response_prefix(prefix, response), np.uint16)
        writers[response + "_mask"] = IndexedDatasetWriter(mask_prefix(response_prefix(prefix, response)), np.uint8)
    same = np.arange(3, 23)
    cut = np.arange(3, 43)
    pairs = [
        (same, same, [0] * 10 + [1] * 10, [0] * 10 + [1] * 10),  # alike
        (cut, np.r_[cut[:35], cut[35:] + 1], [0] * 10 + [1] * 30, [0] * 10 + [1] * 30),  # alike within 33
        (same, same + 1, [0] * 10 + [1] * 10, [0] * 10 + [1] * 10),  # other tokens
        (same, same, [0] * 10 + [1] * 10, [0] * 12 + [1] * 8),  # another mask
    ]
    for chosen, rejected, chosen_mask, rejected_mask in pairs:
        for name, array in zip(writers, (chosen, chosen_mask, rejected, rejected_mask)):
            writers[name].add_document(np.asarray(array))
    for writer in writers.values():
        writer.finalize()
    train, _ = build_preference_datasets(prefix, "100,0,0", 32, 8, 0, seed=0)
    (line,) = train.warning().splitlines()
    assert line.startswith(f"warning: --preference-data {prefix}: 2 of the 4 pairs of the train split have the same")
    assert "add nothing to the gradient" in line
