"""`semfab serve`: the whole token delivery chain behind an OpenAI-compatible URL.

Launches a fabric on this machine (switch, generator workers, host0, and
host1 as the relay for ``--transport host-staged``), starts the chain's tasks,
prints the URL and serves until Ctrl-C, which stops everything.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from fabric.core.moe import MOE_VARIANTS
from fabric.serving.config import DETOK_AT, DETOK_MODES, DETOKENIZERS, TP_PATHS, TRANSPORTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab serve` (defaults from :class:`ServeConfig`)."""
    p.add_argument("--workers", type=int, default=None,
                   help="generator workers (GPUs); default 1, or one group of tp x ep x pp "
                   "for a model (more groups are data-parallel replicas)")
    p.add_argument("--transport", default="direct", choices=TRANSPORTS,
                   help="how token ids reach the host")
    p.add_argument("--detok", default="immediate", choices=DETOK_MODES,
                   help="detokenize every token, or in batches")
    p.add_argument("--detok-at", default="host", choices=DETOK_AT,
                   help="host: stream text; client: stream token ids (the client decodes)")
    p.add_argument("--detokenizer", default="hf", choices=DETOKENIZERS,
                   help="incremental detokenizer implementation")
    p.add_argument("--batch-tokens", type=int, default=8, help="batched: every K tokens ...")
    p.add_argument("--batch-ms", type=float, default=20.0, help="... or after T ms")
    p.add_argument("--step-ms", type=float, default=None,
                   help="decode step time (toy decoder: 10; a model: the least a step "
                   "takes, default 0: as long as its arithmetic and traffic take)")
    p.add_argument("--prefill-ms", type=float, default=None,
                   help="time of a step that admits new requests (toy decoder: 20)")
    p.add_argument("--max-batch", type=int, default=64, help="sequences per worker")
    p.add_argument("--backend", default="auto",
                   help="kernel backend of the toy decoder, and of a --model's attention")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="default sampling temperature")
    p.add_argument("--model", default="semfab-toy",
                   help="semfab-toy (the toy decoder), or a model preset whose arithmetic "
                   "runs here, sharded over the workers: tiny")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the model")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree (attention replicas sharing the experts)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--moe", default="flat", choices=MOE_VARIANTS,
                   help="MoE dispatch and combine: flat, hierarchical or in-network")
    p.add_argument("--tp-path", default="ina", choices=TP_PATHS,
                   help="path of the TP allreduces")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="port (0: any free port)")
    p.add_argument("--record", action="store_true",
                   help="keep per-token timelines (memory grows with traffic)")
    p.add_argument("--run-dir", help="folder for the fabric's logs (default: runs/<stamp>, "
                   "removed after a clean stop)")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep the fabric's run folder after a clean stop")


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C; 0 on a clean stop, 1 if the host task failed."""
    from fabric.emulation.launcher import check_workers
    from fabric.errors import UsageError
    from fabric.serving.config import ServeConfig
    from fabric.serving.http import check_listen
    from fabric.serving.runner import ServingChain

    cfg = ServeConfig(
        transport=args.transport, detok=args.detok, detok_at=args.detok_at,
        detokenizer=args.detokenizer, batch_tokens=args.batch_tokens, batch_ms=args.batch_ms,
        max_batch=args.max_batch, backend=args.backend, temperature=args.temperature,
        model=args.model, tp=args.tp, ep=args.ep, pp=args.pp, moe=args.moe,
        tp_path=args.tp_path, host=args.host, port=args.port, record=args.record,
    )
    if cfg.runs_model:  # a model's steps take what its arithmetic and traffic take
        cfg.step_ms = cfg.prefill_ms = 0.0
    if args.step_ms is not None:
        cfg.step_ms = args.step_ms
    if args.prefill_ms is not None:
        cfg.prefill_ms = args.prefill_ms
    cfg.check()
    workers = args.workers if args.workers is not None else cfg.group_size
    check_workers(workers, "--workers")
    if workers % cfg.group_size:
        raise UsageError(f"--workers {workers} does not split into groups of tp {cfg.tp} x "
                         f"ep {cfg.ep} x pp {cfg.pp}; use a multiple of {cfg.group_size}")
    check_listen(cfg.host, cfg.port)  # a busy port, now rather than after the launch
    if args.run_dir:
        from fabric.emulation.launch_cli import check_dir

        check_dir("--run-dir", args.run_dir)
    chain = ServingChain(cfg, workers=workers, run_dir=args.run_dir)
    code = 1
    keep = bool(args.run_dir or args.keep_runs)
    try:
        chain.start()
        what = (f"model {cfg.model!r} as {workers // cfg.group_size} generator(s) of tp "
                f"{cfg.tp} x ep {cfg.ep} x pp {cfg.pp} (moe {cfg.moe}, tp allreduce "
                f"{cfg.tp_path})" if cfg.runs_model else f"model {cfg.model!r} (toy decoder)")
        print(f"semfab serve: {cfg.label()} on {workers} worker(s), {what}")
        print(f"  OpenAI base URL: {chain.url}/v1")
        print(f"  Prometheus metrics: {chain.url}/metrics")
        print(f"  try: curl -N {chain.url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{cfg.model}\", \"prompt\": \"Hello\", \"max_tokens\": 32, "
              f"\"stream\": true}}'")
        assert chain.fab is not None
        kept = "" if keep else " (removed at a clean stop; --keep-runs keeps them)"
        print(f"  logs: {chain.fab.run_dir}{kept}    stop: Ctrl-C", flush=True)
        while not chain.wait_host(1.0):
            pass
        print("semfab serve: the host task ended", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("\nsemfab serve: stopping", file=sys.stderr)
        code = 0
        return code
    finally:
        chain.close()
        if code == 0 and not keep and chain.fab is not None:  # a failed run keeps its logs
            shutil.rmtree(chain.fab.run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m fabric.serving.cli ...`."""
    from fabric.errors import UsageError

    p = argparse.ArgumentParser(prog="semfab serve", description=__doc__)
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except UsageError as exc:
        print(f"semfab: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
