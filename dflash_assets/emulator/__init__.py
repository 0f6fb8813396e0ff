"""An emulator of an SGLang 0.5.23 server for machines without a GPU, over a deterministic stand-in model (model.py):
`python -m dflash_assets.emulator --model-path emulated/qwen3-27b [flags]`, `main(argv)` or `process.start_emulator`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the emulator until SIGTERM/SIGINT; the exit code (2 for a bad command line, as `sglang serve`)."""
    from .config import resolve
    from .server import serve

    try:
        cfg = resolve(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:  # argparse (2) or a configuration SGLang refuses (1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return e.code or 0
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop=stop)

    asyncio.run(run())
    return 0
