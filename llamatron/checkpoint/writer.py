"""Writing checkpoints: every rank writes its own pieces, in parallel; rank 0 publishes them atomically.

Who writes what (each element of every tensor exactly once):
  * data parallel: dp rank r writes the r-th 1/dp of every gradient bucket: with
    --distributed-optimizer or --fsdp exactly the shard it owns; without it
    every dp rank holds everything, and the writing is spread the same way;
  * tensor parallel: a sharded parameter's rows by the rank holding them (a
    replicated KV row by its lowest holder, padding rows by nobody); a
    replicated parameter (norms, row-parallel biases) by tp rank 0;
  * pipeline: each stage its own layers; the last stage's copy of a tied
    embedding (its spec's `shared_replica`) is not written.

Why pieces in safetensors files with a JSON index rather than
torch.distributed.checkpoint: a rank's shard is not one box of the full
tensor (fused QKV rows, [gate; up], vocabulary padding, replicated KV heads)
and a distributed-optimizer shard is a flat range across rows, so DCP would
need custom planners on its private planner helpers anyway; this way the
files are plain safetensors (no pickle), any tool can read any piece lazily,
and the full-tensor layout of imports is the one-piece case of the same index.

A save: rank 0 makes DIR/.tmp-step-N; every rank writes rank-NNNNN.safetensors
and its RNG state there (with --async-save from CPU copies, in a background
thread while training goes on); then `finish` collects every rank's outcome,
and rank 0 writes index.json and meta.json, renames the directory to
DIR/step-N and only then rewrites DIR/latest. If any rank failed, the
temporary directory is removed and every rank raises: `latest` still names
the previous checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..dtypes import SAFETENSORS_DTYPES, TORCH_DTYPES
from ..errors import CheckpointError
from ..models import build_model
from ..parallel.param_spec import ParamSpec
from .pieces import Box, local_pieces
from .reader import (
    BASE_KEY,
    INDEX_FILE,
    META_FILE,
    CheckpointReader,
    StoredPiece,
    StoredTensor,
    index_to_json,
    intact_copy,
    is_complete,
    latest_name,
    piece_key,
    rank_file,
    rng_file,
    step_dirs,
)
from .rng import rng_state, write_rng
from .tensor_io import StreamingSafetensorsWriter


class Engine(Protocol):
    """What a rank writes from: a training engine (training/engine.py) as this module reads it."""

    mesh: Any
    buffers: list
    optimizer: Any
    model_cfg: Any


@dataclass
class PieceToWrite:
    kind: str
    name: str
    full_shape: tuple[int, ...]
    box: Box
    data: torch.Tensor


@dataclass
class PendingSave:
    """A save whose files are being (or have been) written; `finish` publishes it."""

    root: Path
    step: int
    tmp: Path
    meta: dict[str, Any]
    listing: list[tuple]  # (kind, name, full shape, dtype name, offsets, sizes) of this rank's pieces
    file: str | None
    thread: threading.Thread | None = None
    error: str | None = None
    checksum: str | None = None  # sha256 of this rank's file, for the index
    renamed: bool = False  # step-N is in place (rank 0), whether or not `latest` names it yet
    keep_last: int = 0
    expected: dict[str, tuple[int, ...]] | None = None  # every weight's full shape (rank 0 checks the index)

    @property
    def final(self) -> Path:
        return self.root / f"step-{self.step}"


def engine_params(engine) -> list[tuple[nn.Parameter, ParamSpec]]:
    """Every parameter of this rank with its spec: those that train (the gradient buffers hold them, chunk by
    chunk), then the frozen ones."""
    return [(p, spec) for buf in engine.buffers for p, spec in buf.spec_of.items()] + list(engine.frozen)


def _responsible_for(spec: ParamSpec, tp_rank: int) -> bool:
    if spec.shared_replica:
        return False
    return spec.split_over_tp or tp_rank == 0


def rank_pieces(engine, frozen: bool = True) -> list[PieceToWrite]:
    """The pieces this rank writes: weights, optimizer state and step counts, as views of the live tensors; the
    frozen weights too unless `frozen` is False (a base checkpoint holds them)."""
    mesh, opt = engine.mesh, engine.optimizer
    segment_of = {id(seg.param): i for i, seg in enumerate(opt.segments)}
    out: list[PieceToWrite] = []
    for buf in engine.buffers:
        if not buf.writes_checkpoint:  # hybrid sharding: another replica writes this shard
            continue
        for bucket in buf.buckets:
            share = bucket.numel // buf.dp  # every replica (dp x cp, experts: their own) writes its share
            lo = bucket.start + buf.replica_rank * share
            for p in bucket.params:
                spec = buf.spec_of[p]
                start, end = buf.param_range[p]
                a, b = max(start, lo) - start, min(end, lo + share) - start
                if a >= b or not _responsible_for(spec, mesh.tp_rank):
                    continue
                i = segment_of[id(p)]
                seg = opt.segments[i]
                first = a - seg.param_offset
                if first < 0 or first + (b - a) > seg.end - seg.start:
                    raise CheckpointError(f"{spec.global_name}: range [{a}, {b}) is not in this rank's optimizer shard")
                sources = {"model": buf.param_data[buf.local(start + a, start + b)]}  # p's own elements
                # the optimizer's state, by the kinds it declares
                sources |= {kind: t[first : first + b - a] for kind, t in opt.state(i).items()}
                if not opt.master_is_param:
                    sources["master"] = opt.master[i][first : first + b - a]
                name, full = spec.global_name, spec.full_shape
                for lp in local_pieces(spec, a, b, owned_only=True):
                    out += [PieceToWrite(kind, name, full, lp.box, lp.view(flat)) for kind, flat in sources.items()]
                    if not any(lp.box.offsets):  # the writer of the tensor's first element also writes its step
                        out.append(PieceToWrite("step", name, (1,), Box((0,), (1,)), opt.steps[i].reshape(1)))
    return out + (_frozen_pieces(engine) if frozen else [])


def _frozen_pieces(engine) -> list[PieceToWrite]:
    """The weights of parameters that do not train (no optimizer state): the first replica writes them."""
    mesh, out = engine.mesh, list[PieceToWrite]()
    if mesh.replica_rank != 0:
        return out
    for p, spec in engine.frozen:
        if not _responsible_for(spec, mesh.tp_rank):
            continue
        flat = p.detach().reshape(-1)
        for lp in local_pieces(spec, 0, p.numel(), owned_only=True):
            out.append(PieceToWrite("model", spec.global_name, spec.full_shape, lp.box, lp.view(flat)))
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_INJECTED = "No space left on device (injected: FaultInjection.fail_save)"


def write_files(
    tmp: Path, rank: int, pieces: list[PieceToWrite], rng: dict[str, Any], fail: bool = False
) -> str | None:
    """This rank's safetensors file and RNG state, flushed to disk; returns the file's sha256 (None: no file).
    fail: a test's injected failure half-way."""
    digest = None
    if pieces:
        specs = [(piece_key(p.kind, p.name, p.box), p.data.dtype, p.box.sizes) for p in pieces]
        path = tmp / rank_file(rank)
        with StreamingSafetensorsWriter(path, specs) as writer:
            for n, (spec, piece) in enumerate(zip(specs, pieces)):
                if fail and n == len(pieces) // 2:
                    raise OSError(errno.ENOSPC, _INJECTED, str(path))
                writer.write(spec[0], piece.data)
        digest = writer.sha256.hexdigest()
        _fsync(path)
    elif fail:
        raise OSError(errno.ENOSPC, _INJECTED)
    write_rng(tmp / rng_file(rank), rng)
    return digest


def _snapshot(pieces: list[PieceToWrite]) -> list[PieceToWrite]:
    """CPU copies, so training can go on changing the live tensors (one copy, from any device)."""
    out = []
    for p in pieces:
        copy = torch.empty(p.data.shape, dtype=p.data.dtype, device="cpu")
        copy.copy_(p.data)
        out.append(PieceToWrite(p.kind, p.name, p.full_shape, p.box, copy))
    return out


def start_save(
    engine: Engine,
    root: str | Path,
    step: int,
    meta: dict[str, Any],
    background: bool,
    keep_last: int = 0,
    fail: bool = False,
) -> PendingSave:
    """Write this rank's files of checkpoint `step` (in a thread with `background`); publish with `finish`.

    keep_last: --keep-last, applied once it is published; fail: a test's injected write failure.
    Failures are kept in the returned PendingSave, not raised: `finish` tells every rank, so none hangs.
    """
    mesh = engine.mesh
    root = Path(root)
    pending = PendingSave(root, step, root / f".tmp-step-{step}", meta, [], None, keep_last=keep_last)
    plain = {n: tuple(p.shape) for n, p in build_model(engine.model_cfg, device="meta").named_parameters()}
    added = _added_params(engine, plain)  # a collective: every rank, before rank 0 alone goes on
    if mesh.rank == 0:
        pending.expected = plain | added
        if BASE_KEY in meta:  # what the base holds is not written again
            base = CheckpointReader(meta[BASE_KEY]["path"]).names("model")
            pending.expected = {n: s for n, s in pending.expected.items() if n not in base}
        try:
            if pending.tmp.exists() and pending.tmp == protected_copy(root):  # the only copy `latest` has
                os.replace(pending.tmp, root / f".old-step-{step}")
            if pending.tmp.exists():  # left by a save that crashed
                shutil.rmtree(pending.tmp)
            (pending.tmp / "rng").mkdir(parents=True)
        except OSError as e:
            pending.error = _describe(mesh.rank, e)
    _barrier()
    for buf in engine.buffers:  # the distributed optimizer's parameter all-gather may still be in flight
        buf.finish_param_gather()
    pieces = rank_pieces(engine, frozen=BASE_KEY not in meta)
    pending.listing = [
        (p.kind, p.name, p.full_shape, SAFETENSORS_DTYPES[p.data.dtype], p.box.offsets, p.box.sizes) for p in pieces
    ]
    pending.file = rank_file(mesh.rank) if pieces else None
    rng = rng_state()

    def write(to_write: list[PieceToWrite]) -> None:
        try:
            pending.checksum = write_files(pending.tmp, mesh.rank, to_write, rng, fail)
        except Exception as e:
            pending.error = pending.error or _describe(mesh.rank, e)

    if pending.error:
        return pending
    if not background:
        write(pieces)
        return pending
    try:
        snapshot = _snapshot(pieces)
    except Exception as e:  # e.g. no host memory for the copies
        pending.error = _describe(mesh.rank, e)
        return pending
    pending.thread = threading.Thread(target=write, args=(snapshot,), name=f"checkpoint-step-{step}")
    pending.thread.start()
    return pending


def _describe(rank: int, e: Exception) -> str:
    return f"rank {rank}: {type(e).__name__}: {e}"


def finish(engine: Engine, pending: PendingSave) -> str:
    """Wait for every rank's writes, then publish step-N and `latest` (rank 0), or discard it everywhere."""
    if pending.thread is not None:
        pending.thread.join()
    report = (pending.error, pending.file, pending.listing, pending.checksum)
    reports: list[Any] | None = [report]
    outcome: list[str | None] = [None]
    if dist.is_initialized():
        reports = [None] * dist.get_world_size() if engine.mesh.rank == 0 else None
        dist.gather_object(report, reports, dst=0)
    if engine.mesh.rank == 0:
        assert reports is not None  # rank 0 gathered them
        errors = [r[0] for r in reports if r[0]]
        try:
            if errors:
                raise CheckpointError("; ".join(errors))
            _publish(pending, reports)
        except Exception as e:
            shutil.rmtree(pending.tmp, ignore_errors=True)
            if pending.renamed:
                outcome[0] = (
                    f"saving {pending.final} failed after it was written ({e}): {pending.root}/latest could not "
                    f"be updated and still names the previous checkpoint; load {pending.final} by name"
                )
            else:
                outcome[0] = (
                    f"saving {pending.final} failed ({e}); nothing was published: {pending.root}/latest "
                    f"still names the previous checkpoint"
                )
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        error = CheckpointError(outcome[0])
        error.same_on_every_rank = True  # rank 0 broadcast it: printed once
        raise error
    return str(pending.final)


def _publish(pending: PendingSave, reports: list[tuple]) -> None:
    """Rank 0: index and meta into the temporary directory, rename it into place, then `latest`, then retention."""
    tensors: dict[str, dict[str, StoredTensor]] = {}
    files = sorted(r[1] for r in reports if r[1])
    for _, fname, listing, _ in reports:
        for kind, name, shape, dtype, offsets, sizes in listing:
            box = Box(tuple(offsets), tuple(sizes))
            entry = tensors.setdefault(kind, {}).setdefault(name, StoredTensor(tuple(shape), TORCH_DTYPES[dtype], []))
            entry.pieces.append(StoredPiece(fname, piece_key(kind, name, box), box))
    for kind, by_name in tensors.items():  # every element written exactly once (pieces are disjoint by construction)
        for name, t in by_name.items():
            stored, want = sum(p.box.numel() for p in t.pieces), int(torch.Size(t.shape).numel())
            if stored != want:
                raise CheckpointError(f"{kind} {name}: the ranks wrote {stored} of its {want} elements")
    written = {n: t.shape for n, t in tensors.get("model", {}).items()}
    if pending.expected is not None and written != pending.expected:
        wrong = sorted(set(written.items()) ^ set(pending.expected.items()))[:10]
        raise CheckpointError(f"the weights written do not match the model: {wrong}")
    trained = set(tensors.get("step", {}))  # all weights, or those that train (frozen ones have no state)
    if not trained <= set(written):
        raise CheckpointError("the ranks wrote optimizer state for tensors that are not among the weights")
    stated: set[str] = set()  # the tensors with some optimizer state (an optimizer may keep other kinds for some)
    for kind in sorted(set(tensors) - {"model", "step"}):  # master weights and the optimizer's own state kinds
        if not set(tensors[kind]) <= trained:
            raise CheckpointError(f"the ranks wrote {kind} for a different set of tensors than the weights")
        stated |= set(tensors[kind]) if kind != "master" else set()
    if stated != trained:
        raise CheckpointError("the ranks wrote optimizer state for a different set of tensors than the weights")
    tmp, root, final = pending.tmp, pending.root, pending.final
    for name, text in (
        (INDEX_FILE, json.dumps(_index_with_checksums(files, tensors, reports), separators=(",", ":"))),
        (META_FILE, json.dumps(pending.meta, indent=1)),
    ):
        (tmp / name).write_text(text)
        _fsync(tmp / name)
    aside = root / f".old-{final.name}"
    if final.exists():  # saving a step again (a resumed run): keep the old one until the new one is in place
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    pending.renamed = True
    _fsync(root)
    write_latest(root, final.name)
    shutil.rmtree(aside, ignore_errors=True)
    apply_retention(root, pending.keep_last, keep=final.name)


def _index_with_checksums(files: list[str], tensors: dict[str, dict[str, StoredTensor]], reports: list[tuple]) -> dict:
    """index.json: the pieces, and each rank file's sha256 (the reader checks it before using the file)."""
    index = index_to_json(files, tensors)
    index["checksums"] = {fname: digest for _, fname, _, digest in reports if fname}
    return index


def write_latest(root: Path, name: str) -> None:
    tmp = root / ".latest.tmp"
    tmp.write_text(name + "\n")
    _fsync(tmp)
    os.replace(tmp, root / "latest")
    _fsync(root)


def apply_retention(root: Path, keep_last: int, keep: str) -> None:
    """Remove what crashed saves left behind; with keep_last K, all but `keep` and the newest K-1 others."""
    for stale in [*root.glob(".tmp-step-*"), *root.glob(".old-step-*")]:
        if stale != protected_copy(root):
            shutil.rmtree(stale, ignore_errors=True)
    if keep_last <= 0:
        return
    steps = [(n, d) for n, d in step_dirs(root) if d.name != keep]
    for _, path in steps[: max(0, len(steps) - (keep_last - 1))]:
        shutil.rmtree(path, ignore_errors=True)


def protected_copy(root: Path) -> Path | None:
    """The intact copy of the step `latest` names when that step directory itself is missing (a save killed while
    replacing it): cleanup must keep it, as the reader loads it (reader.intact_copy)."""
    try:
        name = latest_name(root)
    except CheckpointError:
        return None
    return intact_copy(root, name) if name is not None and not is_complete(root / name) else None


def _added_params(engine, plain: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The full shapes of the parameters added to the `plain` model (LoRA's adapters) that any rank holds (a
    pipeline stage holds its own layers' only), gathered for rank 0."""
    mine = {s.global_name: s.full_shape for _, s in engine_params(engine) if s.global_name not in plain}
    if not dist.is_initialized():
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {n: shape for ranks in every for n, shape in ranks.items()}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


__all__ = [
    "PendingSave",
    "apply_retention",
    "engine_params",
    "finish",
    "rank_pieces",
    "start_save",
    "write_latest",
]
