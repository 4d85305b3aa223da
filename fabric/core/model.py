"""A sharded model's decode step: the model's shape, its layout on GPUs, and what
one step costs in compute and in bytes on the network.

Pure (no clock, no I/O): :class:`ModelConfig` (layers, hidden, heads, experts,
...) with presets, :class:`Layout` (TP, EP, PP, DP degrees), :class:`GpuSpec`
(peak rates), and :func:`decode_step` which turns a batch and a context length
into per-layer parts: the compute time of each part on one GPU (a roofline:
the larger of its FLOPs over the achievable peak and its bytes over the
achievable HBM bandwidth) and the bytes each collective of the step moves.

Layout, per pipeline stage: ``tp * ep`` GPUs. Attention runs ``ep`` data-parallel
replicas of ``tp``-way tensor parallelism (the batch split over the replicas);
the routed experts are divided over ``ep`` groups and each expert's FFN is split
``tp`` ways inside its group. ``dp`` whole copies and ``pp`` stages multiply it:
``world = dp * pp * ep * tp``.

Sources of the presets and the GPU figures are cited where they are defined;
docs/MODELS.md explains the cost model and where it is coarse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fabric.errors import UsageError

__all__ = ["GPUS", "MODELS", "RUNNABLE_PARAMS", "DecodeStep", "GpuSpec", "Layout", "ModelConfig",
           "StepPart", "decode_step", "get_gpu", "get_model"]

#: Bytes per element of the dtypes a model may name.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer, dense or MoE.

    ``experts == 0``: every layer is dense (``ffn`` wide). Otherwise the first
    ``dense_layers`` are dense and the rest route each token to ``top_k`` of
    ``experts`` (each ``moe_ffn`` wide) plus ``shared_experts`` always-on ones.
    ``kv_lora_rank`` > 0 means multi-head latent attention (DeepSeek's MLA): the
    KV cache holds ``kv_lora_rank + rope_dim`` per token and layer.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    ffn: int  # dense layers' intermediate size
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    dtype: str = "bfloat16"
    #: MLA (0: grouped-query attention)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "ffn"):
            if getattr(self, key) < 1:
                raise UsageError(f"model {self.name}: {key} must be >= 1, "
                                 f"got {getattr(self, key)}")
        if self.heads % self.kv_heads:
            raise UsageError(f"model {self.name}: kv_heads {self.kv_heads} must divide "
                             f"heads {self.heads}")
        if self.experts and not (1 <= self.top_k <= self.experts and self.moe_ffn >= 1):
            raise UsageError(f"model {self.name}: need 1 <= top_k <= experts and "
                             f"moe_ffn >= 1 (got top_k {self.top_k}, experts {self.experts})")
        if not 0 <= self.dense_layers <= self.layers:
            raise UsageError(f"model {self.name}: dense_layers must be in 0..{self.layers}")
        if self.dtype not in DTYPE_BYTES:
            raise UsageError(f"model {self.name}: dtype {self.dtype!r} is not one of "
                             f"{', '.join(DTYPE_BYTES)}")

    @property
    def moe(self) -> bool:
        """True when the model routes tokens to experts."""
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def attn_params(self) -> int:
        """Weights of one layer's attention (projections in and out)."""
        h = self.hidden
        if self.kv_lora_rank:  # MLA: q down/up, kv down (+ rope key), kv up, out
            qk = self.head_dim + self.rope_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * self.heads * qk
                 if self.q_lora_rank else h * self.heads * qk)
            kv = (h * (self.kv_lora_rank + self.rope_dim)
                  + self.kv_lora_rank * self.heads * (self.head_dim + self.v_head_dim))
            return q + kv + self.heads * self.v_head_dim * h
        q = h * self.heads * self.head_dim
        kv = 2 * h * self.kv_heads * self.head_dim
        return q + kv + self.heads * self.head_dim * h

    @property
    def kv_per_token(self) -> int:
        """KV-cache elements per token and layer."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.rope_dim
        return 2 * self.kv_heads * self.head_dim

    def params(self) -> int:
        """All weights (embedding and LM head counted once each)."""
        dense_ffn = 3 * self.hidden * self.ffn
        expert = 3 * self.hidden * self.moe_ffn
        per_moe = (self.experts + self.shared_experts) * expert + self.hidden * self.experts
        n_dense = self.layers - self.moe_layers
        return (self.layers * self.attn_params + n_dense * dense_ffn
                + self.moe_layers * per_moe + 2 * self.vocab * self.hidden)


#: A model with more parameters than this is timed only: its arithmetic does not
#: run here (fabric.core.decoder runs the smaller ones).
RUNNABLE_PARAMS = 100_000_000

#: Presets. ``tiny`` is small enough that its arithmetic really runs on a CPU;
#: the others are shaped like public models (their config.json on the model hub:
#: mistralai/Mixtral-8x7B-v0.1 and deepseek-ai/DeepSeek-V3).
MODELS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                        vocab=512, ffn=128, experts=4, top_k=2, moe_ffn=64, dtype="float32"),
    "mixtral-8x7b": ModelConfig("mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8,
                                head_dim=128, vocab=32000, ffn=14336, experts=8, top_k=2,
                                moe_ffn=14336),
    "deepseek-v3": ModelConfig("deepseek-v3", layers=61, hidden=7168, heads=128, kv_heads=128,
                               head_dim=128, vocab=129280, ffn=18432, experts=256, top_k=8,
                               moe_ffn=2048, shared_experts=1, dense_layers=3,
                               q_lora_rank=1536, kv_lora_rank=512, rope_dim=64,
                               v_head_dim=128),
}


def get_model(name: str) -> ModelConfig:
    """A preset by name (one-line UsageError naming the presets otherwise)."""
    try:
        return MODELS[name]
    except KeyError:
        raise UsageError(f"unknown model {name!r}; presets: {', '.join(MODELS)}") from None


@dataclass(frozen=True)
class GpuSpec:
    """Peak rates of one GPU and the share of them a decode kernel reaches."""

    name: str
    tflops: float  # dense 16-bit tensor-core peak
    hbm_gbs: float  # HBM bandwidth, GB/s
    #: achievable shares (assumed, not measured: docs/MODELS.md)
    flops_eff: float = 0.6
    hbm_eff: float = 0.8


#: NVIDIA's datasheets (H100 SXM5 and H200 SXM: 989 TFLOP/s dense BF16;
#: HBM3 3.35 TB/s, HBM3e 4.8 TB/s).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", tflops=989.0, hbm_gbs=3350.0),
    "h200": GpuSpec("h200", tflops=989.0, hbm_gbs=4800.0),
}


def get_gpu(name: str) -> GpuSpec:
    """GPU figures by name (one-line UsageError naming the known ones otherwise)."""
    try:
        return GPUS[name]
    except KeyError:
        raise UsageError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism: tensor, expert, pipeline and data."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.ep * self.tp

    def check(self, m: ModelConfig) -> None:
        """One-line UsageError when ``m`` cannot be laid out this way."""
        for key in ("tp", "ep", "pp", "dp"):
            if getattr(self, key) < 1:
                raise UsageError(f"--{key} must be >= 1, got {getattr(self, key)}")
        if m.heads % self.tp:
            raise UsageError(f"--tp {self.tp} does not divide {m.name}'s {m.heads} heads; "
                             f"choose a divisor of {m.heads}")
        if self.ep > 1 and not m.moe:
            raise UsageError(f"--ep {self.ep}: {m.name} has no experts; use --ep 1")
        if m.moe and m.experts % self.ep:
            raise UsageError(f"--ep {self.ep} does not divide {m.name}'s {m.experts} experts; "
                             f"choose a divisor of {m.experts}")
        if self.pp > m.layers:
            raise UsageError(f"--pp {self.pp} is more stages than {m.name}'s {m.layers} layers")

    def fits(self, workers: int) -> None:
        """One-line UsageError when the layout needs more GPUs than ``workers``."""
        if self.world > workers:
            raise UsageError(f"layout tp {self.tp} x ep {self.ep} x pp {self.pp} x dp {self.dp} "
                             f"needs {self.world} GPUs; the topology has {workers} workers")


@dataclass(frozen=True)
class StepPart:
    """One part of a layer in the decode step, on one GPU."""

    name: str  # attention, tp-allreduce, ffn, shared, experts, ep-dispatch, ep-combine, ...
    layers: int  # how many layers of the stage have it
    compute_us: float = 0.0  # per layer
    flops: float = 0.0
    hbm_bytes: float = 0.0
    #: bytes this GPU puts on the network per layer (its share of the collective)
    net_bytes: float = 0.0
    #: the collective's message per GPU (what the collective is called with)
    message_bytes: float = 0.0


@dataclass(frozen=True)
class DecodeStep:
    """What one decode step costs one GPU of one stage, part by part."""

    model: ModelConfig
    layout: Layout
    gpu: GpuSpec
    batch: int  # sequences per data-parallel copy
    context: int
    parts: tuple[StepPart, ...] = field(default=())

    @property
    def compute_us(self) -> float:
        """Compute of one token step through every stage (the stages run in turn)."""
        return self.layout.pp * sum(p.compute_us * p.layers for p in self.parts)

    def net_bytes(self, name: str) -> float:
        """Bytes one GPU sends for part ``name`` over the whole step (every stage)."""
        return self.layout.pp * sum(p.net_bytes * p.layers for p in self.parts
                                    if p.name == name)


def _roofline(gpu: GpuSpec, flops: float, nbytes: float) -> float:
    """Microseconds of a kernel that does ``flops`` and moves ``nbytes`` of HBM."""
    return 1e6 * max(flops / (gpu.tflops * 1e12 * gpu.flops_eff),
                     nbytes / (gpu.hbm_gbs * 1e9 * gpu.hbm_eff))


def _ring_allreduce_bytes(message: float, n: int) -> float:
    """Bytes each of ``n`` ranks sends in a ring allreduce of ``message`` bytes."""
    return 2.0 * (n - 1) / n * message if n > 1 else 0.0


def decode_step(m: ModelConfig, layout: Layout, gpu: GpuSpec, *, batch: int,
                context: int) -> DecodeStep:
    """The parts of one decode step (each sequence gains one token) of ``batch``
    sequences per data-parallel copy, each with ``context`` tokens cached.

    Per layer of a stage, on one GPU: attention (its weights over ``tp``, its
    share of the KV cache read) and the TP allreduce after it; then the FFN: a
    dense FFN over ``tp``, or the shared experts (as a dense FFN) and the
    routed experts: each token's hidden state to ``top_k`` experts (EP
    dispatch), the experts' FFN on the tokens that reach this GPU's group, the
    weighted results back (EP combine); then the TP allreduce after the FFN.
    Routing is taken as uniform. Once per step: the LM head (over ``tp``) and
    the hidden states handed from stage to stage (PP). Layers of a kind that do
    not divide evenly over the stages count as their average per stage.
    """
    layout.check(m)
    if batch < 1 or context < 0:
        raise UsageError(f"need batch >= 1 and context >= 0, got {batch}, {context}")
    b, t, e, pp = m.elem_bytes, layout.tp, layout.ep, layout.pp
    h = m.hidden
    local = batch / e  # sequences on one attention replica (the batch split over ep)
    per_stage = m.layers / pp
    dense, moe = (m.layers - m.moe_layers) / pp, m.moe_layers / pp
    parts: list[StepPart] = []

    def add(name: str, layers: float, flops: float = 0.0, hbm: float = 0.0,
            net: float = 0.0, message: float = 0.0) -> None:
        if layers:
            us = _roofline(gpu, flops, hbm) if flops or hbm else 0.0
            parts.append(_per_stage(StepPart(name, 0, us, flops, hbm, net, message), layers))

    kv_split = t if m.kv_lora_rank == 0 and m.kv_heads % t == 0 else 1  # MLA: replicated
    add("attention", per_stage,
        2.0 * local * m.attn_params / t
        + 4.0 * local * context * m.heads * (m.head_dim + m.rope_dim) / t,
        m.attn_params * b / t + local * context * m.kv_per_token * b / kv_split)
    if t > 1:  # after attention and after the FFN (Megatron's two per layer)
        msg = local * h * b
        add("tp-allreduce", 2 * per_stage, net=_ring_allreduce_bytes(msg, t), message=msg)
    w = 3 * h * m.ffn
    add("ffn", dense, 2.0 * local * w / t, w * b / t)
    if m.moe:
        w = 3 * h * m.moe_ffn * m.shared_experts
        add("shared", moe if m.shared_experts else 0.0, 2.0 * local * w / t, w * b / t)
        picks = batch * m.top_k  # the copy's tokens choose top_k experts each
        per_group = m.experts // e
        # expected experts of this group hit at least once by ``picks`` uniform picks
        hit = per_group * (1.0 - (1.0 - 1.0 / m.experts) ** picks)
        w = 3 * h * m.moe_ffn
        flops = 2.0 * (picks / e) * w / t + 2.0 * local * h * m.experts / t  # + the gate
        add("experts", moe, flops, hit * w * b / t)
        # each token's hidden state to its top_k experts; the share on other groups
        # leaves (the tp ranks of a replica split its tokens between them)
        msg = local * m.top_k * h * b / t
        add("ep-dispatch", moe, net=msg * (e - 1) / e, message=msg)
        add("ep-combine", moe, net=msg * (e - 1) / e, message=msg)
    w = m.vocab * h
    add("lm-head", 1 / pp, 2.0 * local * w / t, w * b / t)
    if pp > 1:
        msg = local * h * b / t
        add("pp-send", (pp - 1) / pp, net=msg, message=msg)
    return DecodeStep(m, layout, gpu, batch, context, tuple(parts))


def _per_stage(p: StepPart, layers: float) -> StepPart:
    """``p`` with a whole count of layers: a fractional count (uneven stages, or a
    once-per-step part spread over the stages) is folded into the per-layer
    figures, so ``layers * figure`` stays the stage's average."""
    whole = max(math.ceil(layers), 1)
    f = layers / whole
    return StepPart(p.name, whole, p.compute_us * f, p.flops * f, p.hbm_bytes * f,
                    p.net_bytes * f, p.message_bytes)
