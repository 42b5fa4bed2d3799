"""`dspark scale verifier|drafter N` and `dspark pools`: set and show a running deployment's pools."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def add_parsers(sub) -> None:
    scale = sub.add_parser("scale", help="set the replica count of a running deployment's pool")
    scale.add_argument("pool", choices=("verifier", "drafter"))
    scale.add_argument("replicas", type=int)
    pools = sub.add_parser("pools", help="show a running deployment's pools, replicas and scale events")
    for p in (scale, pools):
        p.add_argument("--address", default="auto", help="Ray cluster of the deployment (default: this node's)")
        p.add_argument("--namespace", default="dspark", help="Ray namespace of the deployment")


def run_scale(args: argparse.Namespace) -> int:
    from cluster.ray_local import join

    join(args.address, args.namespace)
    import ray

    from cluster.controller import CONTROLLER

    try:
        controller = ray.get_actor(CONTROLLER, namespace=args.namespace)
        if args.command == "scale":
            status = ray.get(controller.scale.remote(args.pool, args.replicas))
        else:
            status = ray.get(controller.status.remote())
    except ray.exceptions.RayTaskError as error:
        Console(stderr=True).print(f"[red]error:[/red] {error.cause}")
        return 2
    finally:
        ray.shutdown()
    Console().print(status_table(status))
    return 0


def status_table(status: dict) -> Table:
    table = Table(title="dspark pools")
    for col in ("pool", "target", "min..max", "replica", "state", "address"):
        table.add_column(col)
    for role, p in status["pools"].items():
        bounds = f"{p['min']}..{p['max']}"
        for i, r in enumerate(p["replicas"] or [{"replica_id": "-", "state": "-", "address": None}]):
            table.add_row(role if i == 0 else "", str(p["target"]) if i == 0 else "", bounds if i == 0 else "",
                          r["replica_id"], r["state"], r["address"] or "-")
    for e in status["events"][-5:]:
        table.caption = (table.caption or "") + f"\n{e['pool']}: {e['before']} → {e['after']} ({e['reason']})"
    return table
