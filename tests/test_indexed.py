"""The .bin/.idx reader and writer, checked against an independent implementation."""

import os
import pickle
import struct

import numpy as np
import pytest

from llamatron.data.indexed import IndexedDataset, IndexedDatasetWriter, best_token_dtype

# --- A minimal reader and writer written from the format description only. ---
# They share no code with llamatron so that a bug in one is not mirrored in the other.

FORMAT_CODES = {"B": 1, "b": 2, "h": 3, "i": 4, "q": 5, "d": 6, "f": 7, "H": 8}  # struct letter -> dtype code
CODE_TO_LETTER = {code: letter for letter, code in FORMAT_CODES.items()}


def reference_write(prefix, documents, letter):
    """documents: list of documents, each a list of sequences (lists of ints)."""
    itemsize = struct.calcsize("<" + letter)
    sizes, pointers, doc_idx = [], [], [0]
    offset = 0
    with open(prefix + ".bin", "wb") as data:
        for document in documents:
            for sequence in document:
                data.write(struct.pack(f"<{len(sequence)}{letter}", *sequence))
                sizes.append(len(sequence))
                pointers.append(offset)
                offset += len(sequence) * itemsize
            doc_idx.append(len(sizes))
    with open(prefix + ".idx", "wb") as index:
        index.write(b"MMIDIDX\x00\x00")
        index.write(struct.pack("<Q", 1))
        index.write(struct.pack("<B", FORMAT_CODES[letter]))
        index.write(struct.pack("<Q", len(sizes)))
        index.write(struct.pack("<Q", len(doc_idx)))
        index.write(struct.pack(f"<{len(sizes)}i", *sizes))
        index.write(struct.pack(f"<{len(pointers)}q", *pointers))
        index.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def reference_read(prefix):
    """Returns (letter, list of sequences, doc_idx)."""
    with open(prefix + ".idx", "rb") as index:
        raw = index.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    assert version == 1
    (code,) = struct.unpack_from("<B", raw, 17)
    num_seqs, num_docs = struct.unpack_from("<QQ", raw, 18)
    position = 34
    sizes = struct.unpack_from(f"<{num_seqs}i", raw, position)
    position += 4 * num_seqs
    pointers = struct.unpack_from(f"<{num_seqs}q", raw, position)
    position += 8 * num_seqs
    doc_idx = struct.unpack_from(f"<{num_docs}q", raw, position)
    assert position + 8 * num_docs == len(raw)
    letter = CODE_TO_LETTER[code]
    with open(prefix + ".bin", "rb") as data:
        blob = data.read()
    sequences = [list(struct.unpack_from(f"<{size}{letter}", blob, pointer)) for size, pointer in zip(sizes, pointers)]
    return letter, sequences, list(doc_idx)


# --- Fixtures ---

DOCUMENTS = [[[1, 2, 3]], [[4], [5, 6]], [[]], [[7, 8, 9, 10, 11]]]  # a multi-sequence and an empty document


def write_with_llamatron(prefix, documents, dtype):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for document in documents:
            for sequence in document:
                writer.add_item(sequence)
            writer.end_document()


@pytest.fixture
def dataset_prefix(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_with_llamatron(prefix, DOCUMENTS, np.uint16)
    return prefix


# --- Round trips ---


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.float32, np.float64])
def test_round_trip(tmp_path, dtype):
    prefix = str(tmp_path / "data")
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 100, size=n).astype(dtype) for n in (5, 0, 17, 1, 300)]
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for sequence in sequences:
            writer.add_document(sequence)
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(sequences)
    assert dataset.dtype == np.dtype(dtype)
    assert dataset.sizes.tolist() == [len(s) for s in sequences]
    assert dataset.doc_idx.tolist() == list(range(len(sequences) + 1))
    for i, sequence in enumerate(sequences):
        np.testing.assert_array_equal(dataset[i], sequence)
    np.testing.assert_array_equal(dataset.get(4, offset=10, length=7), sequences[4][10:17])
    np.testing.assert_array_equal(dataset.get(4, offset=290), sequences[4][290:])
    np.testing.assert_array_equal(dataset[-1], sequences[-1])


def test_multi_sequence_documents(dataset_prefix):
    dataset = IndexedDataset(dataset_prefix)
    assert dataset.doc_idx.tolist() == [0, 1, 3, 4, 5]
    assert dataset.num_documents == 4
    assert [dataset[i].tolist() for i in range(len(dataset))] == [s for d in DOCUMENTS for s in d]
    assert dataset.num_tokens == 11


def test_out_of_range(dataset_prefix):
    dataset = IndexedDataset(dataset_prefix)
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    with pytest.raises(IndexError):
        dataset.get(0, offset=2, length=5)


def test_pickle_reopens_instead_of_copying(dataset_prefix):
    dataset = IndexedDataset(dataset_prefix)
    payload = pickle.dumps(dataset)
    assert len(payload) < 500
    assert pickle.loads(payload)[4].tolist() == [7, 8, 9, 10, 11]


def test_llamatron_files_read_by_reference_reader(dataset_prefix):
    letter, sequences, doc_idx = reference_read(dataset_prefix)
    assert letter == "H"
    assert sequences == [s for d in DOCUMENTS for s in d]
    assert doc_idx == [0, 1, 3, 4, 5]


@pytest.mark.parametrize("letter", ["H", "i", "q", "B"])
def test_reference_files_read_by_llamatron(tmp_path, letter):
    prefix = str(tmp_path / "reference")
    reference_write(prefix, DOCUMENTS, letter)
    dataset = IndexedDataset(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [s for d in DOCUMENTS for s in d]
    assert dataset.doc_idx.tolist() == [0, 1, 3, 4, 5]
    assert dataset.dtype.itemsize == struct.calcsize(letter)


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    IndexedDatasetWriter(prefix, np.uint16).finalize()
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 0 and dataset.doc_idx.tolist() == [0]


def test_writer_is_atomic(tmp_path):
    prefix = str(tmp_path / "sub" / "data")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("crash mid-write")
    assert os.listdir(tmp_path / "sub") == []
    writer = IndexedDatasetWriter(prefix, np.uint16)
    writer.add_document([1, 2, 3])
    assert not os.path.exists(prefix + ".idx")  # nothing visible before finalize
    writer.finalize()
    assert sorted(os.listdir(tmp_path / "sub")) == ["data.bin", "data.idx"]


def test_writer_rejects_tokens_that_do_not_fit(tmp_path):
    writer = IndexedDatasetWriter(str(tmp_path / "x"), np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        writer.add_document(np.array([70000]))
    writer.discard()


def test_best_token_dtype():
    assert best_token_dtype(32000) == np.uint16
    assert best_token_dtype(65499) == np.uint16
    assert best_token_dtype(65500) == np.int32
    assert best_token_dtype(128256) == np.int32


# --- Corruption: each names the file and the problem. ---


def patch_bytes(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_missing_files(dataset_prefix):
    os.remove(dataset_prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"corpus\.bin"):
        IndexedDataset(dataset_prefix)
    with pytest.raises(FileNotFoundError, match=r"nothing\.idx"):
        IndexedDataset(dataset_prefix + "nothing")


def test_wrong_magic(dataset_prefix):
    patch_bytes(dataset_prefix + ".idx", 0, b"NOTMAGIC!")
    with pytest.raises(ValueError, match=r"corpus\.idx.*magic"):
        IndexedDataset(dataset_prefix)


def test_unsupported_version(dataset_prefix):
    patch_bytes(dataset_prefix + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(ValueError, match=r"corpus\.idx.*unsupported index version 2"):
        IndexedDataset(dataset_prefix)


def test_unknown_dtype_code(dataset_prefix):
    patch_bytes(dataset_prefix + ".idx", 17, struct.pack("<B", 42))
    with pytest.raises(ValueError, match=r"corpus\.idx.*unknown dtype code 42"):
        IndexedDataset(dataset_prefix)


def test_truncated_bin(dataset_prefix):
    with open(dataset_prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(dataset_prefix + ".bin") - 2)
    with pytest.raises(ValueError, match=r"corpus\.bin.*truncated"):
        IndexedDataset(dataset_prefix)


def test_truncated_index(dataset_prefix):
    with open(dataset_prefix + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(dataset_prefix + ".idx") - 8)
    with pytest.raises(ValueError, match=r"corpus\.idx.*truncated"):
        IndexedDataset(dataset_prefix)


def test_inconsistent_pointers(dataset_prefix):
    num_seqs = 5
    second_pointer = 34 + 4 * num_seqs + 8
    patch_bytes(dataset_prefix + ".idx", second_pointer, struct.pack("<q", 4))
    with pytest.raises(ValueError, match=r"corpus\.idx.*inconsistent pointers.*sequence 1"):
        IndexedDataset(dataset_prefix)


def test_token_id_range_reads_in_chunks(tmp_path):
    prefix = str(tmp_path / "ids")
    rng = np.random.default_rng(0)
    sequences = [rng.integers(-50, 1000, size=n) for n in (100, 0, 333, 7)]
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for sequence in sequences:
            writer.add_document(sequence)
    every = np.concatenate(sequences)
    dataset = IndexedDataset(prefix)
    for chunk_bytes in (4, 36, 1 << 20):  # chunk boundaries inside and across sequences
        assert dataset.token_id_range(chunk_bytes) == (int(every.min()), int(every.max()))
    IndexedDatasetWriter(str(tmp_path / "empty"), np.uint16).finalize()
    assert IndexedDataset(str(tmp_path / "empty")).token_id_range() == (0, -1)


def test_missing_prefix_suggests_the_preprocess_output_name(tmp_path):
    import numpy as np
    import pytest

    from llamatron.data.indexed import IndexedDataset, IndexedDatasetWriter

    with IndexedDatasetWriter(str(tmp_path / "corpus_text_document")) as w:
        w.add_document(np.arange(5))
    with pytest.raises(Exception, match=r"did you mean .*corpus_text_document"):
        IndexedDataset(str(tmp_path / "corpus"))
