"""``python -m labsrc.serving --model lab-target --port 8000``: serve the engine over HTTP (OpenAI's
``/v1/completions``, streaming or not). See :mod:`labsrc.serving.server`."""
from __future__ import annotations

import argparse


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m labsrc.serving", description=__doc__)
    parser.add_argument("--model", default="lab-target", help="a shipped name or a checkpoint folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--kernels", choices=("triton", "torch"), default=None,
                        help="default: triton on a GPU, the PyTorch references on a CPU")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="largest request body accepted (413 beyond); default 1 MiB")
    args = parser.parse_args(argv)

    import uvicorn

    from labsrc import runtime
    from labsrc.models import load
    from labsrc.serving.engine import Engine
    from labsrc.serving.server import MAX_REQUEST_BYTES, create_app

    model, tokenizer = load(args.model, device=runtime.DEVICE)
    engine = Engine(model, num_blocks=args.num_blocks, block_size=args.block_size,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                    tokenizer=tokenizer, enable_prefix_caching=not args.no_prefix_caching, kernels=args.kernels)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1/completions ({engine.kernels} kernels)",
          flush=True)
    app = create_app(engine, args.model, max_request_bytes=args.max_request_bytes or MAX_REQUEST_BYTES)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
