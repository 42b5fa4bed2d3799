"""`dspark top`: the live load board in the terminal (every verifier and drafter, fresh or stale)."""

from __future__ import annotations

import argparse
import os
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from services.load_board import RedisBoard, connect_board

STALE_AFTER_S = 0.5


def add_parser(sub) -> None:
    top = sub.add_parser("top", help="show the live load board (Redis)")
    top.add_argument("--redis-url", default=os.environ.get("DSPARK_REDIS_URL", "redis://127.0.0.1:6379/0"),
                     help="the board (default: DSPARK_REDIS_URL, which keeps a password off the command line)")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print the board once and exit")


def board_table(board: RedisBoard) -> Table:
    table = Table(title=f"dspark load board — {time.strftime('%H:%M:%S')}")
    for col in ("role", "engine", "running", "queued", "KV used", "step ms (EMA)", "saturation", "age s", "seq"):
        table.add_column(col, justify="left" if col in ("role", "engine") else "right")
    now = time.time()
    for role in ("verifier", "drafter"):
        loads = board.read(role)
        if loads is None:
            table.add_row(role, "[red]board unavailable", *[""] * 7)
            continue
        for x in loads:
            kv = f"{x.kv_used}/{x.kv_total}" if x.kv_total else "-"
            table.add_row(role, x.engine_id, str(x.running), str(x.queued), kv, f"{x.step_ms_ema:.1f}",
                          f"{x.saturation(STALE_AFTER_S, now):.2f}", f"{x.age_s(now):.2f}", str(x.seq))
    return table


def run_top(args: argparse.Namespace) -> int:
    board = connect_board(args.redis_url, timeout_s=0.5)
    if args.once:
        Console().print(board_table(board))
        return 0
    with Live(board_table(board), refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(args.interval)
                live.update(board_table(board))
        except KeyboardInterrupt:
            return 0
