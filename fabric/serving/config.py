"""Settings of one serving chain: the strategy under test and the toy model (pure).

A :class:`ServeConfig` is built on the launcher side, checked once with
:meth:`ServeConfig.check`, and sent (pickled) to every task of the chain, so
the generator, the relay and the host always agree on the strategy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fabric.errors import UsageError, check_number

#: How token ids travel from the generator to the host.
#: ``direct``: a memory-semantic WRITE of fixed 32-byte records into a token
#: ring registered on the host (no serialisation). ``host-staged``: a staging
#: copy, a msgpack message, a relay process on a second host node that
#: decodes and re-encodes it, then the front-end host.
TRANSPORTS = ("direct", "host-staged")
#: When text is made: per token, or every ``batch_tokens`` tokens / ``batch_ms``.
DETOK_MODES = ("immediate", "batched")
#: Where text is made: on the host (OpenAI-compatible text) or near the client
#: (the host streams token ids; the client detokenizes).
DETOK_AT = ("host", "client")
#: Incremental detokenizer implementation (both built on the HF tokenizer):
#: ``hf`` is tokenizers' own DecodeStream; ``table`` a byte table + UTF-8 decoder.
DETOKENIZERS = ("hf", "table")
#: Longest decode step, prefill or detokenizer batch window, in ms.
MAX_STEP_MS = 60_000.0

#: Model name served on /v1/models.
DEFAULT_MODEL = "semfab-toy"
#: Paths of a sharded model's TP allreduces (integers: fixed-point sums).
TP_PATHS = ("ina", "ina-mem", "host-ps", "host-ring")


@dataclass
class ServeConfig:
    """Everything the tasks of one chain need to agree on."""

    transport: str = "direct"
    detok: str = "immediate"
    detok_at: str = "host"
    detokenizer: str = "hf"
    batch_tokens: int = 8  # batched detok: flush every k tokens...
    batch_ms: float = 20.0  # ...or when the oldest pending token is this old
    # generation
    step_ms: float = 10.0  # one decode step of the stand-in model
    prefill_ms: float = 20.0  # a step that admits new requests takes this long...
    prefill_ms_per_token: float = 0.0  # ...plus this per prompt token
    max_batch: int = 64  # sequences per worker
    backend: str = "auto"  # kernels backend of the toy decoder and a model's attention
    kernel_threads: int = 1  # numba threads per worker (one "GPU" per process)
    toy_vocab: int = 512
    toy_dim: int = 64
    temperature: float = 1.0
    seed: int = 0
    # the model: DEFAULT_MODEL is the toy decoder above (one worker a generator);
    # a preset of fabric.core.model whose arithmetic runs here ("tiny") is sharded
    # tp x ep x pp over a group of workers, each group one generator
    model: str = DEFAULT_MODEL
    tp: int = 1
    ep: int = 1
    pp: int = 1
    moe: str = "flat"  # MoE dispatch/combine variant (fabric.core.moe.MOE_VARIANTS)
    tp_path: str = "ina"  # path of the TP allreduces
    # presentation
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    max_tokens_limit: int = 4096
    max_queue: int = 1024  # open requests before the server answers 429
    token_timeout_s: float = 30.0  # a stream with no token for this long fails
    fast_write: bool = True  # write SSE events from the token callback (see http.py)
    # plumbing, filled in by the runner
    ring_slots: int = 4096  # token ring records per worker (direct)
    record: bool = False  # keep per-token timelines and generated ids (bench, tests)
    session: int = 0
    assets_dir: str = ""
    ready_file: str = ""
    secret: str = ""
    relay: str = "host1"  # relay node of host-staged
    # direct on one host, no shaping or faults on the way (set by the runner): the
    # generator writes its records into host0's ring in shared memory and posts
    # the WRITE's header to host0 through a doorbell (fabric.emulation.doorbell), no socket
    bells: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self) -> ServeConfig:
        """Raise UsageError naming the first bad setting; return self."""
        for name, valid in (("transport", TRANSPORTS), ("detok", DETOK_MODES),
                            ("detok_at", DETOK_AT), ("detokenizer", DETOKENIZERS)):
            value = getattr(self, name)
            if value not in valid:
                raise UsageError(f"unknown {name.replace('_', '-')} {value!r}; "
                                 f"choose one of {', '.join(valid)}")
        if self.batch_tokens < 1:
            raise UsageError("batch-tokens must be >= 1")
        # a decode step or a batch of a minute is a typo, and would look like a hang
        check_number("--batch-ms", self.batch_ms, above=0, most=MAX_STEP_MS)
        check_number("--step-ms", self.step_ms, least=0, most=MAX_STEP_MS)
        check_number("--prefill-ms", self.prefill_ms, least=0, most=MAX_STEP_MS)
        check_number("prefill-ms-per-token", self.prefill_ms_per_token, least=0,
                     most=MAX_STEP_MS)
        if not 1 <= self.max_batch <= 4096:
            raise UsageError("max-batch must be 1..4096")
        if self.toy_vocab < 2 or self.toy_dim < 1:
            raise UsageError("toy model needs vocab >= 2 and dim >= 1")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"port {self.port} is not 0..65535")
        if self.ring_slots < self.max_batch:
            raise UsageError("ring-slots must hold at least one step (>= max-batch)")
        if not 0 <= self.temperature <= 2:  # also refuses NaN
            raise UsageError(f"temperature {self.temperature:g} must be in 0..2")
        self._check_model()
        from kernels.backends import VALID_NAMES

        if self.backend not in VALID_NAMES:  # now, not in a worker after the launch
            raise UsageError(f"unknown backend {self.backend!r}; choose one of "
                             f"{', '.join(VALID_NAMES)}")
        return self

    def _check_model(self) -> None:
        from fabric.core.model import MODELS, RUNNABLE_PARAMS, Layout
        from fabric.core.moe import MOE_VARIANTS

        if self.model not in MODELS:
            if (self.tp, self.ep, self.pp) != (1, 1, 1):
                runnable = " or ".join(n for n, m in MODELS.items()
                                       if m.params() <= RUNNABLE_PARAMS)
                raise UsageError(f"--tp/--ep/--pp shard a model preset; {self.model!r} is the "
                                 f"toy decoder's name. Choose --model {runnable}")
            return
        m = MODELS[self.model]
        if m.params() > RUNNABLE_PARAMS:
            raise UsageError(f"{self.model} is timed only (its arithmetic does not run here); "
                             f"serve runs tiny, and `semfab bench decode --model {self.model}` "
                             "times it")
        Layout(tp=self.tp, ep=self.ep, pp=self.pp).check(m)
        if self.moe not in MOE_VARIANTS:
            raise UsageError(f"unknown --moe {self.moe!r}; choose one of "
                             f"{', '.join(MOE_VARIANTS)}")
        if self.tp_path not in TP_PATHS:
            raise UsageError(f"unknown --tp-path {self.tp_path!r}; choose one of "
                             f"{', '.join(TP_PATHS)}")

    @property
    def runs_model(self) -> bool:
        """Whether the generator is a sharded model preset (not the toy decoder)."""
        from fabric.core.model import MODELS

        return self.model in MODELS

    @property
    def group_size(self) -> int:
        """Workers per generator: the model's tp x ep x pp, or 1 (toy decoder)."""
        return self.tp * self.ep * self.pp

    @property
    def input_vocab(self) -> int:
        """Token ids the generator takes (prompt ids are folded into it)."""
        from fabric.core.model import MODELS

        return MODELS[self.model].vocab if self.runs_model else self.toy_vocab

    def label(self) -> str:
        """Short strategy name, e.g. ``direct+immediate`` or ``host-staged+batched@client``."""
        text = f"{self.transport}+{self.detok}"
        return text if self.detok_at == "host" else f"{text}@client"

    def replace(self, **changes: Any) -> ServeConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)
