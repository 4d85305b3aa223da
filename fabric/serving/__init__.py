"""The token delivery chain: generation, transport, interpretation, presentation.

DESIGN.md section 1.1. Worker nodes run a toy decoder and stand in for GPUs;
their token ids cross the fabric to the host node, which detokenizes them with
a Hugging Face ``tokenizers`` byte-level BPE and streams text to clients over
an OpenAI-compatible HTTP API. Every token is timestamped at each layer
boundary, and every copy, encode, process crossing and switch hop on its way
is counted, so strategies can be compared side by side (``semfab bench
tokens``). The user guide is docs/SERVING.md.

Modules (pure ones never touch sockets or clocks):

* :mod:`~fabric.serving.config` -- the strategy and model settings (pure)
* :mod:`~fabric.serving.records` -- the 32-byte token record and staged messages (pure)
* :mod:`~fabric.serving.assets` -- training text, tokenizer training and cache
* :mod:`~fabric.serving.detok` -- incremental detokenizers and the batching policy (pure)
* :mod:`~fabric.serving.api` -- OpenAI request validation, chunks, SSE framing (pure)
* :mod:`~fabric.serving.metrics` -- TTFT/TPOT/ITL/E2EL, layers, goodput, experience (pure)
* :mod:`~fabric.serving.trace` -- Chrome Trace Event JSON builder (pure)
* :mod:`~fabric.serving.prom` -- Prometheus metrics in the text exposition format (pure)
* :mod:`~fabric.serving.dataset` -- benchmark prompts (corpus, sonnet, random) and arrivals
* :mod:`~fabric.serving.generator` -- worker (generator) and relay tasks
* :mod:`~fabric.serving.host` -- the host task: token NIC, detokenizer, HTTP server
* :mod:`~fabric.serving.client` -- a streaming HTTP client that timestamps events
* :mod:`~fabric.serving.runner` -- bring the chain up and down from the launcher side
* :mod:`~fabric.serving.cli` -- ``semfab serve``
"""

from fabric.serving.config import DETOK_AT, DETOK_MODES, DETOKENIZERS, TRANSPORTS, ServeConfig

__all__ = ["DETOKENIZERS", "DETOK_AT", "DETOK_MODES", "TRANSPORTS", "ServeConfig"]
