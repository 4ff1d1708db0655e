"""``python -m questkv.server --model MODEL [engine flags] [Quest flags] --host 127.0.0.1 --port 8000``
(``MODEL`` alone, positional, also works)."""

from __future__ import annotations

import argparse
import sys

from questkv.server.launch import add_serve_args, run_server


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m questkv.server",
        description="Serve MODEL over an OpenAI-compatible HTTP API (completions, chat completions, SSE streams), "
        "with Quest decoding and a per-request \"quest\": {\"token_budget\": N} or {\"dense\": true}.",
    )
    add_serve_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
