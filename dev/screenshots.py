"""`make screenshots`: docs/screenshots/*.png, one per page, from the demo's database.

Drives Debian's chromium (/usr/bin/chromium, or $CHROMIUM) through Playwright's Python API;
nothing is downloaded. Stops the server, the worker and the embedded PostgreSQL it started.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final

from dev.dashboard_demo import LIVE_SLUG, demo_database, live_trickle

CHROMIUM: Final = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS: Final = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dev.screenshots")
    parser.add_argument("--out", default="docs/screenshots")
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args(argv)
    import uvicorn
    from playwright.sync_api import sync_playwright

    from agent_runs.dashboard import create_app
    from agent_runs.dashboard.hosts import served_hosts
    from agent_runs.db import connect, create_pool
    from agent_runs.repository import AgentRunRepository

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (
        demo_database(args.dsn) as dsn,
        live_trickle(dsn, every=1.0),
        create_pool(dsn, min_size=1, max_size=4) as pool,
    ):
        time.sleep(8)  # a few live runs come and go
        with connect(dsn) as conn:
            repo = AgentRunRepository(conn)
            planner = repo.list_runs(agent_slug="planner", limit=1)[0]
            failed = repo.list_runs(statuses=["failed"], limit=1)[0]
        port = _free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(pool, allow_cancel=True, allowed_hosts=served_hosts("127.0.0.1", port)),
                host="127.0.0.1",
                port=port,
                log_level="warning",
                lifespan="off",
            )
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        shots = {
            "overview": "/",
            "runs": "/runs?limit=20",
            "runs-filtered": f"/runs?status=completed&status=failed&agent_slug={LIVE_SLUG}",
            "run": f"/runs/{planner.id}",
            "run-failed": f"/runs/{failed.id}",
            "workers": "/workers",
            "runs-error-type": "/runs?error_type=tool_error&finished=1d",
            "tree": f"/tree/{planner.id}",
            "cancel-confirm": f"/cancel-tree/{planner.id}",
        }
        # Other devices: (name, path, viewport, colour scheme).
        variants: list[tuple[str, str, Any, Any]] = [
            ("runs-phone", "/runs", {"width": 390, "height": 844}, "light"),
            ("overview-dark", "/", {"width": 1280, "height": 900}, "dark"),
            ("run-dark", f"/runs/{failed.id}", {"width": 1280, "height": 900}, "dark"),
        ]
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_ARGS))
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                for name, path in shots.items():
                    page.goto(base + path)
                    page.wait_for_selector("main h1")
                    page.screenshot(path=str(out / f"{name}.png"), full_page=True)
                    print(f"wrote {out / f'{name}.png'}", flush=True)
                for name, path, viewport, scheme in variants:
                    other = browser.new_page(viewport=viewport, color_scheme=scheme)
                    other.goto(base + path)
                    other.wait_for_selector("main h1")
                    other.screenshot(path=str(out / f"{name}.png"), full_page=True)
                    other.close()
                    print(f"wrote {out / f'{name}.png'}", flush=True)
                browser.close()
        finally:
            server.should_exit = True
            thread.join(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
