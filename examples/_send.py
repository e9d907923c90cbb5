"""Shared tail of the pytree-kind examples: print what a source would send, and send one
round to a server when ``--server`` is given (any weightwire or stock vLLM server)."""

from __future__ import annotations

import argparse

from weightwire import HTTPWeightSyncClient, JAXTrainerEngine, PytreeSource, TrainerInitInfo


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--server", help="send one round to this server (http://host:port)")
    ap.add_argument(
        "--backend", default="weightwire_tcp", choices=("nccl", "weightwire_nccl", "weightwire_tcp")
    )
    return ap


def report_and_send(source: PytreeSource, args: argparse.Namespace, label: str) -> None:
    metas = source.metadata()
    groups = source.groups()
    print(
        f"{label}: {len(metas)} HF tensors in {len(groups)} layer groups, "
        f"{sum(m.nbytes for m in metas) / 1e6:.2f} MB; first {metas[0].name}, last {metas[-1].name}"
    )
    if not args.server:
        return
    # ready_timeout: a server started beside this script may still be loading (vLLM: minutes).
    client = HTTPWeightSyncClient(args.server, timeout=300, ready_timeout=600)
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend=args.backend), client=client, source=source
    )
    try:
        print(engine.send_weights().summary())
    finally:
        engine.shutdown()
        client.close()
