"""What one micro-batch costs on one GPU, piece by piece: the durations the step simulator (timeline.py) lays
out. Every efficiency comes from calibration.yaml; the FLOPs and bytes are counted from the model's shape.

Per decoder layer and micro-batch on one rank (T tokens: micro-batch x seq / cp; tp shards each GEMM):
  GEMMs      2 x T x linear parameters / tp forward, twice that backward (input and weight gradients, each a
             forward's worth); at peak x gemm efficiency x tokens/(tokens + half) x width/(width + half); --fp8
             divides the decoder linears' time by its measured speed-up. MoE: the router and the experts a token
             reaches (experts_taken) as grouped GEMMs at their own shape (rows per expert, expert width)
  attention  causal work 4 x (attention width / tp) x keys per query x T forward, 3 x that in all (the width
             each layer's attention module declares: heads x head_dim for the shared one)
  elementwise norms, SwiGLU, rotary, residuals as bytes at HBM bandwidth x efficiency; MoE: the permutation's
             passes over the (T x k, hidden) rows, and the routing's per-call time per MoE layer
  TP         all-gathers/reduce-scatters of T x hidden (4 forward, 2 backward exposed, 2 overlapped with the
             weight-gradient GEMMs: llamatron's tensor_layers.py); all-reduces without sequence parallelism
  CP         the whole sequence's K/V gathered in forward, their gradients reduce-scattered in backward
  EP         MoE: all-to-all dispatch and combine of T x k x hidden, twice each way (or HybridEP's copies)
The last chunk adds the head's GEMM and the loss, each micro-batch adds the bf16 -> fp32 gradient
accumulation of every parameter the rank holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...models import ModelConfig
from ...models.inventory import experts_taken, layers, mean_mlp_width, moe_layer_share, per_config
from ...parallel.layout import ParallelLayout
from ...parallel.tensor import padded_vocab_size
from .calibration import Calibration
from .fsdp import FsdpOptions
from .hardware import Hardware

# Tensor-parallel collectives of (tokens x hidden) per layer and micro-batch with sequence parallelism: what
# llamatron/parallel/tensor_layers.py runs, counted, not fitted. Forward: an all-gather before the attention's and
# the MLP's column-parallel linears, a reduce-scatter after their row-parallel ones; backward: the reverse of each,
# two on the critical path and the column-parallel inputs' two reduce-scatters beside the weight-gradient GEMMs.
TP_SP_FORWARD, TP_SP_BACKWARD_EXPOSED, TP_SP_BACKWARD_OVERLAPPED = 4, 2, 2


@dataclass(frozen=True, kw_only=True)
class Shape(ParallelLayout):
    """The parallel layout (parallel/layout.py) and the run settings the costs depend on."""

    micro_batch_size: int = 1
    seq_length: int = 4096
    recompute: str = "none"
    recompute_layers: int | None = None
    act_bytes: int = 2
    compiled: bool = True
    fp8: str = "none"
    attention: str = "auto"
    tp_comm_overlap: bool = True
    # Every tensor-parallel collective overlapped with the GEMM beside it, forward too (Megatron-core's userbuffers,
    # tp_comm_overlap in NeMo's H100 recipes); llamatron overlaps only the backward's two (tp_comm_overlap above).
    tp_overlap_all: bool = False
    # The weight-gradient GEMMs accumulate straight into the fp32 gradient (Megatron-core's
    # gradient_accumulation_fusion, on in NeMo's GPT configs): no separate accumulation kernel per micro-batch.
    fused_grad_accumulation: bool = False
    # --fp8 reaches the experts' grouped GEMMs too (Transformer Engine's GroupedLinear under Megatron-core's FP8);
    # llamatron's --fp8 converts nn.Linear layers only (training/fp8.py), its experts' torch._grouped_mm stays bf16.
    fp8_experts: bool = False
    # The MoE token dispatcher: "alltoall" (NCCL's all-to-all, llamatron's: every token choice a copy to its
    # expert's rank) or "hybridep" (Megatron-core's flex dispatcher with DeepEP's HybridEP backend: a token crosses
    # to a remote node once, then fans out over NVLink, one copy per GPU holding any of its experts).
    ep_dispatcher: str = "alltoall"

    @property
    def tokens(self) -> float:
        return self.micro_batch_size * self.seq_length / self.cp

    @property
    def a2a_tokens(self) -> float:
        """The tokens one rank routes and dispatches: the micro-batch's, or under --etp 1 (experts_fold_tp: every
        expert whole, the tp ranks more expert-parallel ranks, no tp collectives around the routed experts) its tp
        shard."""
        return self.tokens / self.tp if self.experts_fold_tp else self.tokens

    @property
    def a2a_stride(self) -> int:
        """Ranks between two of the all-to-all's (the tp ranks are adjacent: folded in, the stride is cp)."""
        return self.cp if self.experts_fold_tp else self.tp * self.cp


@dataclass(frozen=True)
class StepOptions:
    """How the step runs besides its shape: the schedule, the data-parallel buckets and their overlap."""

    micro_batches: int = 1  # per data-parallel rank and step
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    grad_reduce_bytes: int = 4  # fp32 (2: --grad-reduce-dtype bf16)
    param_gather_bytes: int = 2  # the weights' all-gathers (1: Megatron-core's fp8_param_gather, published runs)
    bucket_size: int = 40_000_000
    schedule: str = "1f1b"  # or "zb-h1"
    fsdp: FsdpOptions | None = None  # --fsdp (simulator/fsdp.py): per-layer gathers and reduce-scatters instead
    optimizer_extra: float = 0.0  # seconds an optimizer adds after the reduction (Muon: planning/muon_cost.py)


@dataclass
class Piece:
    """Seconds of one action by kind (compute, tp, cp, ep: the exposed communication inside it)."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.parts[kind] = self.parts.get(kind, 0.0) + seconds

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    def scaled(self, n: float) -> Piece:
        return Piece({k: v * n for k, v in self.parts.items()})

    def plus(self, other: Piece) -> Piece:
        out = Piece(dict(self.parts))
        for k, v in other.parts.items():
            out.add(k, v)
        return out


@dataclass
class LayerCost:
    forward: Piece
    backward_input: Piece  # everything of the backward but the weight gradients (ZB-H1's B)
    backward_weight: Piece  # the weight-gradient GEMMs (ZB-H1's W)
    recompute: Piece  # what recompute re-runs in backward (full: the forward; selective: attention)


def linear_params(model: ModelConfig) -> tuple[float, float, float]:
    """(attention and dense-MLP linear weights per layer, the router's, the experts' one token reaches: k of them,
    fewer under a capacity: experts_taken), each averaged over the layers (dense layers among MoE ones differ)."""
    all_layers = layers(model)
    share = experts_taken(model) / max(model.num_experts, 1)
    n = len(all_layers)
    dense = sum(float(layer.params("matmul")) for layer in all_layers) / n
    router = sum(float(layer.params("router")) for layer in all_layers) / n
    return dense, router, sum(layer.params("expert") * share for layer in all_layers) / n


@per_config
def keys_per_query(model: ModelConfig, seq: int) -> float:
    """Mean keys a query attends to under the causal mask (and the sliding window or attention chunks, if any),
    averaged over the layers."""
    chunks = [model.layer_attention_chunk(i) for i in range(model.num_layers)]
    return sum(_keys_per_query(model.sliding_window, chunk, seq) for chunk in chunks) / len(chunks)


@per_config
def _chunked(model: ModelConfig, seq: int) -> bool:
    """Whether some layer attends within chunks shorter than the sequence."""
    return any((c or seq) < seq for c in map(model.layer_attention_chunk, range(model.num_layers)))


def _keys_per_query(window: int | None, chunk: int | None, seq: int) -> float:
    if chunk is not None and chunk < seq:  # whole chunks of causal attention, and the rest
        full, rest = divmod(seq, chunk)
        return (full * chunk * (chunk + 1) / 2 + rest * (rest + 1) / 2) / seq
    if window is None or window >= seq:
        return (seq + 1) / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


class Costs:
    """Durations of the pieces of one micro-batch on one rank."""

    def __init__(self, model: ModelConfig, shape: Shape, hw: Hardware, cal: Calibration):
        self.model, self.s, self.hw, self.cal = model, shape, hw, cal
        self.peak = hw.gpu.peak_flops  # efficiencies are fractions of each GPU's own datasheet peak
        self._gemm_rate = self.peak * cal.gemm_efficiency

    # ---- compute ------------------------------------------------------------------------------------------

    def _shape_factor(self, tokens: float, width: float) -> float:
        c = self.cal
        return tokens / (tokens + c.gemm_tokens_half) * width / (width + c.gemm_width_half)

    def gemm_forward(self) -> float:
        """Seconds of one layer's forward GEMMs on this rank."""
        m, s = self.model, self.s
        dense = linear_params(m)[0]
        width = m.hidden_size / s.tp
        fp8 = self.cal.fp8_gemm_speedup.get(s.fp8, 1.0)
        t = 2 * s.tokens * dense / s.tp / (self._gemm_rate * self._shape_factor(s.tokens, width)) / fp8
        return t + self.expert_gemm_forward()

    def expert_gemm_forward(self) -> float:
        """Seconds of one layer's router and experts forward (grouped GEMMs) on this rank, by their own shape: each
        expert's rows (its token choices) and its narrowest side, its ffn (tp-sharded) where narrower than hidden
        (gate_up's N, down's K: fine-grained experts are thin GEMMs). Rows have their own half
        (calibration.yaml gemm.grouped_rows_half): one grouped kernel's tiles span every expert, so few rows per
        expert cost less than a dense GEMM of as few tokens."""
        m, s, c = self.model, self.s, self.cal
        _, router, experts = linear_params(m)
        moe = router + experts
        if not moe:
            return 0.0
        rows = s.tokens * experts_taken(m) * s.ep / m.num_experts  # etp 1: tokens / tp over ep x tp ranks, the same
        width = min(m.hidden_size, m.ffn_hidden_size / (1 if s.experts_fold_tp else s.tp))
        shape = rows / (rows + c.grouped_rows_half) * width / (width + c.gemm_width_half)
        fp8 = c.fp8_gemm_speedup.get(s.fp8, 1.0) if s.fp8_experts else 1.0
        return 2 * s.tokens * moe / s.tp / (self._gemm_rate * c.grouped_gemm_efficiency * shape) / fp8

    def attention_total(self) -> float:
        m, s = self.model, self.s
        attention = layers(m)
        width = sum(layer.attention_width for layer in attention) / len(attention)  # each module's flops_width
        flops = 3 * 4 * (width / s.tp) * keys_per_query(m, s.seq_length) * s.tokens
        head_dim = attention[0].attention.kernel_head_dim
        efficiency = self.cal.attention(self.hw.gpu.name, s.attention, s.seq_length, head_dim)
        windowed = m.sliding_window is not None and m.sliding_window < s.seq_length
        chunked = _chunked(m, s.seq_length)
        if windowed or chunked:  # flex's block mask or FA4's local kernel
            efficiency *= self.cal.attention_window_factor
        return flops / (self.peak * efficiency)

    def elementwise_total(self) -> float:
        m, s, c = self.model, self.s, self.cal
        f = mean_mlp_width(m)
        qkv = layers(m)[0].attention.kernel_input_width
        per_token = s.act_bytes * (
            c.elementwise_per_hidden * m.hidden_size / (s.tp if s.sequence_parallel else 1)
            + (c.elementwise_per_ffn * f + c.elementwise_per_qkv * qkv) / s.tp
        )
        if m.is_moe:  # the token choices' rows permuted to their experts and back, forward and backward
            permuted = c.permutation_passes * s.act_bytes * experts_taken(m) * m.hidden_size * moe_layer_share(m)
            per_token += permuted / (
                s.tp if s.experts_fold_tp else 1
            )  # etp 1: each tp rank permutes its shard's tokens
        t = per_token * s.tokens / (self.hw.gpu.hbm_bw * c.elementwise_hbm_efficiency)
        return t * (1 if s.compiled else c.eager_factor)

    def routing(self) -> float:
        """One layer's routing kernels that take about the same time whatever the tokens (top-k, the sort, the
        counts and offsets, the router losses and statistics, forward and backward): per MoE layer and
        micro-batch, so a step of many small micro-batches pays it often."""
        return self.cal.routing_seconds * moe_layer_share(self.model) if self.model.is_moe else 0.0

    # ---- communication ------------------------------------------------------------------------------------

    def collective(self, kind: str, size: float, ranks: int, per_node: int) -> float:
        """Seconds of one collective of `size` bytes (the whole buffer) over `ranks` ranks, `per_node` of them
        in each node (ranks <= per_node: inside one node, over the GPU link)."""
        if ranks <= 1 or size <= 0:
            return 0.0
        hw, c = self.hw, self.cal
        curve = c.nvlink[kind]
        bus = curve.bus_bandwidth(hw.link.bandwidth, size)
        latency = (ranks - 1) * hw.link.latency
        if kind == "all_reduce" and ranks <= per_node:  # NVLink SHARP: 5-8 GPUs reduce in the switch
            bus *= c.nvls_all_reduce.get(hw.link.name, {}).get(ranks, 1.0)
        volume = (2.0 if kind == "all_reduce" else 1.0) * (ranks - 1) / ranks
        if ranks > per_node:  # across nodes: the NICs of the group's per_node GPUs of each node carry it together
            nics = per_node * hw.nic_bandwidth_per_gpu()
            latency = (ranks - 1) * hw.network.latency
            if kind == "all_reduce":  # NCCL's tree: the buffer leaves and enters each node once, beside the node's
                # own reduce-scatter + all-gather over its GPU link (pipelined with it)
                inside = size * 2 * (per_node - 1) / per_node / bus if per_node > 1 else 0.0
                return latency + max(inside, size / c.network_all_reduce.bus_bandwidth(nics, size))
            bus = min(bus, c.network.bus_bandwidth(nics, size))  # a ring: (ranks-1)/ranks of it over each link
        return latency + size * volume / bus

    def group_per_node(self, stride: int, size: int) -> int:
        """Members of a group of `size` ranks `stride` apart that share one node."""
        return max(1, min(size, self.hw.gpus_per_node // stride)) if stride <= self.hw.gpus_per_node else 1

    def tp_collective(self) -> float:
        """One tensor-parallel collective of T x hidden on the compute path. llamatron's are NCCL calls launched
        from the compute stream and waited for: measured at tp_slowdown x NCCL's benchmark time (calibration.yaml,
        the tp 2 rows). Megatron-core's userbuffers (tp_overlap_all) are not NCCL calls: peer copies beside the GEMM,
        charged the benchmark's time (no measurement of ours or published says more)."""
        s = self.s
        slowdown = 1.0 if s.tp_overlap_all else self.cal.tp_slowdown
        size = s.tokens * self.model.hidden_size * s.act_bytes
        if s.sequence_parallel:
            pair = self.collective("all_gather", size, s.tp, s.tp) + self.collective("reduce_scatter", size, s.tp, s.tp)
            return slowdown * pair / 2
        return slowdown * self.collective("all_reduce", size, s.tp, s.tp)

    def tp_bytes(self) -> float:
        s = self.s
        return s.tokens * self.model.hidden_size * s.act_bytes * (s.tp - 1) / s.tp

    def tp_contention(self, busy: float, beside: float) -> float:
        """Compute lost to overlapped tp collectives that take `busy` seconds beside `beside` seconds of GEMMs: their
        bytes / the contention bandwidth, at most the time they run beside the GEMMs (as the data-parallel buckets'
        and --fsdp's: overlapping never costs more than running the two one after the other)."""
        if busy <= 0:
            return 0.0
        rate = self.tp_bytes() / self.tp_collective() / self.cal.contention_bandwidth  # each collective's bytes/s
        return min(busy, beside) * min(1.0, rate)

    def cp_gather(self) -> float:
        """One layer's K/V all-gather (or its gradients' reduce-scatter) over the cp ranks."""
        m, s = self.model, self.s
        if s.cp == 1:
            return 0.0
        size = s.micro_batch_size * s.seq_length * layers(m)[0].attention.gathered_kv_width(s.tp) * s.act_bytes
        return self.collective("all_gather", size, s.cp, self.group_per_node(s.tp, s.cp))

    def all_to_all_bytes(self) -> float:
        """Bytes one MoE dispatch (or combine) sends off this rank (HybridEP: over the network and NVLink)."""
        m, s = self.model, self.s
        ranks = s.expert_parallel
        if s.ep_dispatcher == "hybridep" and ranks > 1:
            return s.a2a_tokens * m.hidden_size * s.act_bytes * sum(self.hybrid_ep_copies())
        return s.a2a_tokens * experts_taken(m) * m.hidden_size * s.act_bytes * (ranks - 1) / ranks

    def all_to_all(self) -> float:
        """One MoE dispatch (or combine) over the ep ranks: T x k x hidden values (the kept ones under a
        capacity), (ep-1)/ep off the rank."""
        m, s, hw, c = self.model, self.s, self.hw, self.cal
        ranks = s.expert_parallel
        if not m.is_moe or ranks == 1:
            return 0.0
        if s.ep_dispatcher == "hybridep":
            return self.hybrid_ep()
        size = s.a2a_tokens * experts_taken(m) * m.hidden_size * s.act_bytes
        local = self.group_per_node(s.a2a_stride, ranks)
        inside = size * (local - 1) / ranks / (hw.link.bandwidth * c.nvlink["all_to_all"].efficiency)
        outside = 0.0
        if local < ranks:
            outside = size * (ranks - local) / ranks / (hw.nic_bandwidth_per_gpu() * c.network.efficiency)
        latency = hw.network.latency if local < ranks else hw.link.latency
        return latency + max(inside, outside)

    def hybrid_ep_copies(self) -> tuple[float, float]:
        """Per token of this rank and dispatch under HybridEP: (copies over the network, copies over NVLink). A
        token goes once to each remote node holding any of its k experts (node-level dedup), and each node's GPUs
        send it on over NVLink once to every other GPU there holding any of them (both for its own tokens and those
        arriving from the network). With k of E experts chosen uniformly (the even loads assumed throughout), a
        group of g experts holds none of a token's with probability C(E - g, k) / C(E, k)."""
        m, s = self.model, self.s
        ranks = s.expert_parallel
        local = self.group_per_node(s.a2a_stride, ranks)
        nodes = ranks // local
        k, experts = m.experts_per_token, m.num_experts

        def hit(group: float) -> float:
            return 1 - math.comb(experts - round(group), k) / math.comb(experts, k)

        kept = experts_taken(m) / k
        network = (nodes - 1) * hit(experts * local / ranks) * kept
        return network, nodes * (local - 1) * hit(experts / ranks) * kept

    def hybrid_ep(self) -> float:
        """One HybridEP dispatch (or combine): its network and NVLink stages pipelined (warp-level, TMA copies), so
        the slower of the two: the network at the simulator's NIC efficiency, NVLink at the all-to-all curve's."""
        m, s, hw, c = self.model, self.s, self.hw, self.cal
        row = s.tokens * m.hidden_size * s.act_bytes
        network, nvlink = self.hybrid_ep_copies()
        inside = row * nvlink / (hw.link.bandwidth * c.nvlink["all_to_all"].efficiency)
        outside = row * network / (hw.nic_bandwidth_per_gpu() * c.network.efficiency)
        return (hw.network.latency if network else hw.link.latency) + max(inside, outside)

    def p2p(self, across_nodes: bool) -> float:
        s = self.s
        size = s.tokens * self.model.hidden_size * s.act_bytes / (s.tp if s.sequence_parallel else 1)
        if across_nodes:
            return self.hw.network.latency + size / (self.hw.nic_bandwidth_per_gpu() * self.cal.network.efficiency)
        return self.hw.link.latency + size / (self.hw.link.bandwidth * self.cal.nvlink["p2p"].efficiency)

    # ---- one layer ----------------------------------------------------------------------------------------

    def layer(self, recomputed: bool = True) -> LayerCost:
        """One decoder layer's pieces for one micro-batch (recomputed: this layer falls under --recompute)."""
        s, c = self.s, self.cal
        gemm, attn, elem = self.gemm_forward(), self.attention_total(), self.elementwise_total() + self.routing()
        a_fwd = attn * c.attention_forward_share
        tp_one, cp_one, a2a = self.tp_collective(), self.cp_gather(), self.all_to_all()
        fwd = Piece()
        fwd.add("compute", gemm + a_fwd + 0.4 * elem)
        unfolded = 1 - self.mlp_tp_free_share()
        n_fwd = (TP_SP_FORWARD - 2 + 2 * unfolded) if s.sequence_parallel else 2
        if s.tp_overlap_all and s.tp > 1:  # each collective runs under its GEMM: exposed only what outlasts them
            fwd.add("tp", max(0.0, n_fwd * tp_one - gemm))
            fwd.add("contention", min(n_fwd * tp_one, gemm) * c.tp_userbuffers_sm_share)  # SMs taken beside it
        else:
            fwd.add("tp", n_fwd * tp_one)
        fwd.add("cp", cp_one)
        fwd.add("ep", 2 * a2a)
        back = Piece()
        back.add("compute", gemm + attn - a_fwd + 0.6 * elem)
        back.add("cp", cp_one)
        back.add("ep", 2 * a2a)
        weight = Piece({"compute": gemm})
        exposed = (TP_SP_BACKWARD_EXPOSED - 1 + unfolded) if s.sequence_parallel else 1
        overlapped = (TP_SP_BACKWARD_OVERLAPPED - 1 + unfolded) if s.sequence_parallel else 1
        if s.tp_overlap_all and s.tp > 1:  # under the input- and weight-gradient GEMMs together
            back.add("tp", max(0.0, (exposed + overlapped) * tp_one - 2 * gemm))
            back.add("contention", min((exposed + overlapped) * tp_one, 2 * gemm) * c.tp_userbuffers_sm_share)
        else:
            back.add("tp", exposed * tp_one)
        if s.tp > 1 and not s.tp_overlap_all:
            if s.tp_comm_overlap:  # hidden behind the weight-gradient GEMMs, as far as they last
                back.add("tp", max(0.0, overlapped * tp_one - gemm))
                back.add("contention", self.tp_contention(overlapped * tp_one, gemm))
            else:
                back.add("tp", overlapped * tp_one)
        recompute = Piece()
        if recomputed and s.recompute == "full":
            recompute = fwd
        elif recomputed and s.recompute == "selective":
            recompute = Piece({"compute": a_fwd})
        return LayerCost(fwd, back, weight, recompute)

    def mlp_tp_free_share(self) -> float:
        """The share of layers whose MLP runs no tp collective: MoE layers under --etp 1 without a shared expert
        (one of the MLP's gather and reduce-scatter each way, and its backward's two)."""
        m, s = self.model, self.s
        return moe_layer_share(m) if s.experts_fold_tp and not m.shared_expert_ffn else 0.0

    def head(self) -> tuple[Piece, Piece, Piece]:
        """(forward, backward input, backward weight) of the output head and the loss for one micro-batch."""
        m, s = self.model, self.s
        vocab = m.vocab_size if s.tp == 1 else padded_vocab_size(m.vocab_size, s.tp) // s.tp
        gemm = 2 * s.tokens * m.hidden_size * vocab / (self._gemm_rate * self._shape_factor(s.tokens, m.hidden_size))
        loss = (
            s.tokens
            * vocab
            * self.cal.loss_bytes_per_logit
            / (self.hw.gpu.hbm_bw * self.cal.elementwise_hbm_efficiency)
        )
        return Piece({"compute": gemm + 0.4 * loss}), Piece({"compute": gemm + 0.6 * loss}), Piece({"compute": gemm})

    def grad_accumulate(self, params: float) -> float:
        """Adding one micro-batch's bf16 gradients of `params` parameters into the fp32 buffers."""
        if self.s.fused_grad_accumulation:
            return 0.0
        return params * self.cal.grad_accumulate_bytes / (self.hw.gpu.hbm_bw * self.cal.elementwise_hbm_efficiency)

    def optimizer(self, owned: float) -> float:
        return (
            owned * self.cal.optimizer_bytes_per_owned_param / (self.hw.gpu.hbm_bw * self.cal.optimizer_hbm_efficiency)
        )
