"""Pipeline parallelism: cutting the model into stage chunks, moving activations between them, running a step.

`build_stage_chunks` builds this rank's chunks of the pp*vpp that the model's
decoder layers are cut into, on meta; chunk c lives on pipeline rank c % pp
(see schedules.py for the order they run in). Each chunk is the same
`Transformer` class holding only its layers, keyed by their index in the
whole model, and only the ends it holds, so its parameter names are the
unsplit model's (`layers.2.attn.qkv.weight` on the second of two stages) and
initialisation and checkpoints are the same under every layout. Tensor
parallelism is applied to each chunk afterwards.

Tied embeddings (Falcon): the last chunk gets its own copy of the embedding
matrix as its head, `lm_head.weight`, whose spec gives the global name
`embed.weight` (so it is initialised identically and loaded from the same
tensor) and `shared_replica` (checkpoints hold it once, the gradient norm
leaves it out). Each step the two copies' gradients are summed between the
first and the last stage before the data-parallel reduction
(`defer_grad_reduce` in both specs), so both copies take the same update.
A family's extra heads (DeepSeek-V3's multi-token prediction) embed the tokens
ahead on the last stage: it holds a copy of the embedding the same way,
`extra_embed.weight` (Megatron-LM's MTP under a pipeline shares it so too).

Activations travel as (micro_batch, seq / seq_shards, hidden) tensors of the
compute dtype: every rank knows that shape from its own micro-batches, so only
data crosses the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..models import ModelConfig, Transformer, build_model
from ..models.transformer import batch_inputs, embedding_on_last_stage
from .fsdp import Buffer
from .grad_buffer import mark_last_microbatch
from .mesh import Mesh, new_group
from .param_spec import ParamSpecs, param_specs
from .schedules import Action, Message, Step, build_program, input_message, output_message

# ---- stages ----------------------------------------------------------------------------------------


def _parse_pp_layers(pp_layers: str | Sequence[int]) -> list[int] | None:
    try:
        return [int(x) for x in (pp_layers.split(",") if isinstance(pp_layers, str) else pp_layers)]
    except ValueError:
        return None


def pipeline_problems(num_layers: int, pp: int, vpp: int, pp_layers: str | Sequence[int] | None = None) -> list[str]:
    """Why `num_layers` decoder layers cannot be cut into pp*vpp chunks as asked (empty when they can)."""
    if vpp < 1:
        return ["--vpp must be >= 1"]
    if vpp > 1 and pp == 1:
        return ["--vpp needs --pp > 1 (interleaving splits each pipeline rank's layers into chunks)"]
    chunks = pp * vpp
    if pp_layers is not None:
        split = _parse_pp_layers(pp_layers)
        if split is None:
            return [f"--pp-layers {pp_layers!r} must be comma-separated integers"]
        if len(split) != chunks or sum(split) != num_layers or min(split) < 1:
            return [
                f"--pp-layers must give {chunks} positive counts summing to {num_layers} layers (pp*vpp = "
                f"{pp}*{vpp}); got {pp_layers}"
            ]
    elif chunks > num_layers:
        return [
            f"pp*vpp = {chunks} model chunks but only {num_layers} layers: each chunk needs a layer; lower "
            f"--vpp or --pp (pp*vpp at most {num_layers})"
        ]
    elif num_layers % chunks:
        return [f"{num_layers} layers are not divisible by pp*vpp = {chunks}; give an explicit split with --pp-layers"]
    return []


def split_layers(num_layers: int, pp: int, vpp: int = 1, pp_layers: str | Sequence[int] | None = None) -> list[int]:
    """Decoder layers of each of the pp*vpp chunks, in model order (ConfigError when they cannot be cut so)."""
    problems = pipeline_problems(num_layers, pp, vpp, pp_layers)
    if problems:
        raise ConfigError("; ".join(problems))
    split = _parse_pp_layers(pp_layers) if pp_layers is not None else None
    return split if split is not None else [num_layers // (pp * vpp)] * (pp * vpp)


def build_stage_chunks(
    cfg: ModelConfig, mesh: Mesh, vpp: int = 1, pp_layers: str | Sequence[int] | None = None
) -> tuple[list[Transformer], list[ParamSpecs]]:
    """This rank's model chunks on meta (local chunk v is global chunk v*pp + pp_rank) and their parameter specs."""
    pp = mesh.layout.pp
    split = split_layers(cfg.num_layers, pp, vpp, pp_layers)
    starts = [sum(split[:c]) for c in range(len(split))]
    group = _tied_embedding_group(mesh) if pp > 1 and embedding_on_last_stage(cfg) else None
    chunks, tables = [], []
    for v in range(vpp):
        c = v * pp + mesh.pp_rank
        is_first, is_last = c == 0, c == pp * vpp - 1
        chunk = build_model(cfg, layers=range(starts[c], starts[c] + split[c]), embed=is_first, head=is_last)
        chunk.parallel.tied_embedding_group = group if (is_first or is_last) else None
        chunks.append(chunk)
        tables.append(_tied_embedding_specs(chunk, param_specs(chunk)))
    return chunks, tables


def _tied_embedding_specs(chunk: Transformer, specs: ParamSpecs) -> ParamSpecs:
    """Mark the embedding and its copy (a tied head, or the extra heads' embedding) on a chunk holding one end of
    the model (not both)."""
    if chunk.is_first_stage == chunk.is_last_stage or not embedding_on_last_stage(chunk.cfg):
        return specs
    specs = dict(specs)
    if chunk.is_first_stage:
        specs["embed.weight"] = replace(specs["embed.weight"], defer_grad_reduce=True)
    # a copy of the embedding: the same tensor in checkpoints and init, counted once in the norm
    for copy in ("lm_head.weight", "extra_embed.weight") if chunk.cfg.tie_embeddings else ("extra_embed.weight",):
        if copy in specs:
            specs[copy] = replace(specs[copy], global_name="embed.weight", shared_replica=True, defer_grad_reduce=True)
    return specs


def _tied_embedding_group(mesh: Mesh) -> dist.ProcessGroup | None:
    """The group of the first and last stage of my pipeline. Every rank creates every group, in one order."""
    if not dist.is_initialized():
        return None
    mine = None
    for d in range(mesh.layout.dp):
        for c in range(mesh.layout.cp):
            for t in range(mesh.layout.tp):
                ranks = [mesh.rank_of(t, d, 0, c), mesh.rank_of(t, d, mesh.layout.pp - 1, c)]
                group = new_group(ranks)  # carries --dist-timeout
                if mesh.rank in ranks:
                    mine = group
    return mine


def _tied_params(chunk: Transformer) -> list[nn.Parameter]:
    """The copy of a shared embedding this chunk holds: the embedding on the first stage, the tied head or the
    extra heads' embedding on the last (none when it is frozen: it has no gradient)."""
    if chunk.parallel.tied_embedding_group is None:
        return []
    heads = (chunk.lm_head,) if chunk.cfg.tie_embeddings else ()
    copies = [m.weight for m in (chunk.embed, *heads, chunk.extra_embed) if m is not None]
    return [p for p in copies if isinstance(p, nn.Parameter) and p.requires_grad]


def sum_tied_embedding_grads(chunks: list[Transformer], buffers: Sequence[Buffer]) -> None:
    """Add the first and last stage's gradients of a tied embedding (before the data-parallel reduction)."""
    for chunk, buffer in zip(chunks, buffers):
        for p in _tied_params(chunk):
            buffer.zero_if_unwritten(p)
            dist.all_reduce(buffer.grad(p), group=chunk.parallel.tied_embedding_group)


# ---- point-to-point ----------------------------------------------------------------------------------


class _Batch:
    """One batch_isend_irecv: its requests and the send buffers they must keep alive."""

    def __init__(self, works: list, sends: list[torch.Tensor]):
        self.works, self.sends = works, sends

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.sends = [], []


_warmed_groups: set[int] = set()


class P2P:
    """Sends and receives between the stages of this rank's pipeline, in the order the schedule fixes."""

    def __init__(self, mesh: Mesh, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.group, self.ranks, self.me = mesh.pp_group, mesh.pp_ranks, mesh.pp_rank
        self.shape, self.dtype, self.device = shape, dtype, device
        self.outbox: dict[Message, torch.Tensor] = {}
        self.inbox: dict[Message, tuple[torch.Tensor, _Batch]] = {}
        self.in_flight: list[_Batch] = []
        key = id(self.group)
        if key not in _warmed_groups:
            # NCCL: the first operation on a group must involve all its ranks; later p2p batches need not.
            dist.all_reduce(torch.zeros(1, device=device), group=self.group)
            _warmed_groups.add(key)

    def issue(self, messages: list[Message]) -> None:
        if not messages:
            return
        ops, sends, received = [], [], []
        for m in messages:
            if m.src == self.me:
                t = self.outbox.pop(m).contiguous()
                if t.shape != self.shape or t.dtype != self.dtype:  # the receiver allocated by the known shape
                    raise RuntimeError(
                        f"pipeline stage output {tuple(t.shape)} {t.dtype} differs from the "
                        f"transfer shape {self.shape} {self.dtype}"
                    )
                sends.append(t)
                ops.append(dist.P2POp(dist.isend, t, self.ranks[m.dst], self.group))
            else:
                t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                received.append((m, t))
                ops.append(dist.P2POp(dist.irecv, t, self.ranks[m.src], self.group))
        batch = _Batch(dist.batch_isend_irecv(ops), sends)
        for m, t in received:
            self.inbox[m] = (t, batch)
        self.in_flight.append(batch)
        self._release_finished()

    def _release_finished(self) -> None:
        """Drop finished batches so their send buffers are freed without waiting for the end of the step."""
        still = []
        for batch in self.in_flight:
            if batch.works and batch.done():
                batch.wait()
            if batch.works:
                still.append(batch)
        self.in_flight = still

    def take(self, m: Message) -> torch.Tensor:
        t, batch = self.inbox.pop(m)
        batch.wait()
        return t

    def finish(self) -> None:
        for batch in self.in_flight:
            batch.wait()
        self.in_flight = []
        if self.inbox or self.outbox:
            raise RuntimeError(f"pipeline step ended with messages left: {list(self.inbox) + list(self.outbox)}")


# ---- running a step ----------------------------------------------------------------------------------


def _activation_shape(engine, micro_batches: list[dict]) -> tuple[int, int, int]:
    batch, seq = micro_batches[0]["input_ids"].shape
    shards = engine.chunks[0].parallel.sequence_shards
    return batch, seq // shards, engine.model_cfg.hidden_size


def _program(engine, num_micro_batches: int, forward_only: bool) -> tuple[Step, ...]:
    return build_program(
        engine.mesh.layout.pp, len(engine.chunks), num_micro_batches, engine.mesh.pp_rank, forward_only
    )


class _Runner:
    """Runs one rank's program: forwards, backwards and the transfers between them."""

    def __init__(self, engine, micro_batches: list[dict], forward_only: bool):
        self.engine = engine
        self.pp = engine.mesh.layout.pp
        self.num_chunks = self.pp * len(engine.chunks)
        self.program = _program(engine, len(micro_batches), forward_only)
        self.p2p = P2P(engine.mesh, _activation_shape(engine, micro_batches), engine.dtype, engine.device)
        # awaiting backward: (input, the loss on the last stage, else the output's gradient edge)
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | torch.autograd.graph.GradientEdge]] = {}

    def run(
        self, forward: Callable[[Action, torch.Tensor | None], torch.Tensor | None], backward: Callable | None
    ) -> None:
        for step in self.program:
            for round_ in step.rounds:
                self.p2p.issue(round_.messages)
            a = step.action
            if a is None:
                continue
            needs = input_message(a, self.pp, self.num_chunks)
            received = self.p2p.take(needs) if needs is not None else None
            if a.forward:
                out = forward(a, received)
            else:
                assert backward is not None, "a backward action in a forward-only program"
                out = backward(a, received)
            sends = output_message(a, self.pp, self.num_chunks)
            if sends is not None:
                assert out is not None, f"{a} produced nothing to send"
                self.p2p.outbox[sends] = out
        self.p2p.finish()

    def chunk(self, a: Action) -> Transformer:
        return self.engine.chunks[a.chunk // self.pp]

    def is_last(self, a: Action) -> bool:
        return a.chunk == self.num_chunks - 1


def pipeline_forward_backward(engine, micro_batches: list[dict], normaliser: torch.Tensor) -> torch.Tensor:
    """One step of pipelined forward and backward over this rank's micro-batches; the last stage's outputs go to
    the engine's objective (`engine.objective.loss(logits, micro-batch, normaliser)`).

    Returns the step's loss (the sum of the objective's micro-batch losses) on the last stage, 0 elsewhere.
    """
    runner = _Runner(engine, micro_batches, forward_only=False)
    loss_sum = torch.zeros((), device=engine.device)
    last_mb = len(micro_batches) - 1

    def forward(a: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal loss_sum
        mb = micro_batches[a.micro_batch]
        if a.chunk == 0:
            x = mb["input_ids"]
        else:
            assert received is not None, f"{a} received no activation"
            x = received.requires_grad_()
        if runner.is_last(a):
            out = engine.objective.loss(runner.chunk(a)(x, **batch_inputs(mb)), mb, normaliser)
            loss_sum = loss_sum + out.detach()
        else:
            out = runner.chunk(a)(x, **batch_inputs(mb))
        if runner.is_last(a):
            runner.saved[(a.chunk, a.micro_batch)] = (x, out)
            return None
        # Keep only the graph edge that backward starts from, not the output: its values now belong to the
        # send, whose buffer is freed once the transfer completes (Megatron keeps them until backward).
        runner.saved[(a.chunk, a.micro_batch)] = (x, torch.autograd.graph.get_gradient_edge(out))
        return out.detach()

    def backward(a: Action, grad: torch.Tensor | None) -> torch.Tensor | None:
        x, out = runner.saved.pop((a.chunk, a.micro_batch))
        # Buckets of this chunk reduce during the backward of its last micro-batch, once per step.
        mark_last_microbatch(engine.buffers, engine.chunks[a.chunk // runner.pp], a.micro_batch == last_mb)
        torch.autograd.backward(out, grad_tensors=grad)
        return x.grad if a.chunk > 0 else None

    runner.run(forward, backward)
    if runner.saved:
        raise RuntimeError(f"pipeline step ended with activations never backpropagated: {sorted(runner.saved)}")
    sum_tied_embedding_grads(engine.chunks, engine.buffers)
    return loss_sum


@torch.no_grad()
def pipeline_forward_each(
    engine, micro_batches: list[dict], on_output: Callable[[nn.Module, torch.Tensor, dict], None]
) -> None:
    """Forward every micro-batch through the pipeline (no backward); on the last stage, call
    on_output(last chunk, its logits, the micro-batch) for each. Chunks run in eval mode."""
    was_training = [c.training for c in engine.chunks]
    for c in engine.chunks:
        c.eval()
    runner = _Runner(engine, micro_batches, forward_only=True)

    def forward(a: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        mb = micro_batches[a.micro_batch]
        chunk = runner.chunk(a)
        out = chunk(mb["input_ids"] if a.chunk == 0 else received, **batch_inputs(mb))
        if not runner.is_last(a):
            return out
        on_output(chunk, out, mb)
        return None

    try:
        runner.run(forward, None)
    finally:
        for c, training in zip(engine.chunks, was_training):
            c.train(training)
