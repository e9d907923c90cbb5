"""Per-round time of 2 broadcasting trainer ranks vs 1, on CPU (issue 20's closing note).

The same model bytes go to the reference server (``--replicas`` worker replicas) over
``weightwire_tcp``, first from one sender (rank 0 owns everything), then from two
trainer ranks (threads over a ``DictGroup``; ``OwnedSource`` gives rank 0 the
embeddings and the first half of the layers, rank 1 the rest, each on its own TCP
star). Models are random Llama checkpoints of the given sizes, built once under
``--cache``; every round is verified against the server's checksums once at the end.

    python benchmarks/bench_multi_source.py --sizes 4,32,96 --rounds 7

Prints one JSON row per size and mode, then a Markdown table (median of the rounds
after one warm-up round). Threads share the GIL, so this measures the wire and
control plane with two stars, not two trainer processes' packing in parallel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

SHAPES = {4: (256, 1024, 1), 32: (384, 1536, 4), 96: (512, 2048, 6)}
"""Approximate float32 MB -> (hidden_size, intermediate_size, layers)."""


def build(mb: int, cache: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightwire.tools.server.tiny import tiny_model_dir

    out = cache / f"llama-{mb}mb"
    if (out / "config.json").is_file():
        return out
    hidden, inter, layers = SHAPES[mb]
    tiny = Path(tiny_model_dir("tiny-llama"))
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.update(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, head_dim=hidden // 2
    )
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in tiny.iterdir():  # the tokenizer
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    data = json.loads((out / "config.json").read_text())
    data.update({"torch_dtype": "float32", "dtype": "float32"})
    (out / "config.json").write_text(json.dumps(data, indent=2))
    return out


def info(rank: int) -> Any:
    from weightwire.shared.timeouts import Timeouts
    from weightwire.trainer import TrainerInitInfo

    return TrainerInitInfo(
        backend="weightwire_tcp",
        rank=rank,
        pause_mode="keep",
        timeouts=Timeouts(http_s=120, connect_s=60, warmup_s=60, transfer_s=60),
    )


def _send(engine: Any, barrier: threading.Barrier, errors: list[BaseException]) -> None:
    try:
        barrier.wait(60)
        engine.send_weights()
    except BaseException as exc:  # reported by timed_rounds
        errors.append(exc)


def timed_rounds(engines: list[Any], rounds: int) -> list[float]:
    """``rounds`` rounds, every rank on its own thread; rank 0's wall time per round."""
    out: list[float] = []
    for _ in range(rounds):
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(engines))
        threads = [threading.Thread(target=_send, args=(e, barrier, errors)) for e in engines[1:]]
        for t in threads:
            t.start()
        started = time.perf_counter()
        _send(engines[0], barrier, errors)
        out.append(time.perf_counter() - started)
        for t in threads:
            t.join(300)
        if errors:
            raise errors[0]
    return out


def bench(mb: int, model_dir: Path, rounds: int, replicas: int) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    from weightwire.control import HTTPWeightSyncClient
    from weightwire.shared.owned import OwnedSource
    from weightwire.tools.demo.server import EmbeddedServer
    from weightwire.torch_side.sender.engine import TorchTrainerEngine, tensor_bytes
    from weightwire.torch_side.sender.source import ModuleSource
    from weightwire.trainer.group import DictGroup

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    full = ModuleSource(model)
    nbytes = sum(m.nbytes for m in full.metadata())
    half = model.config.num_hidden_layers // 2 or 1

    def owner(name: str) -> int:
        if name.startswith("model.embed_tokens"):
            return 0
        if name.startswith("model.layers."):
            return 0 if int(name.split(".")[2]) < half else 1
        return 1

    rows = []
    with EmbeddedServer(
        str(model_dir), extra_args=["--replicas", str(replicas)], startup_timeout=300
    ) as server:
        assert server.url is not None
        client = HTTPWeightSyncClient(server.url, timeout=120)
        single = TorchTrainerEngine.trainer_init(info(0), client=client, source=full)
        try:
            one = timed_rounds([single], rounds + 1)[1:]
        finally:
            single.shutdown()
        groups = DictGroup.make(2)
        engines: list[Any] = [None, None]

        def init(r: int) -> None:
            engines[r] = TorchTrainerEngine.trainer_init(
                info(r),
                client=HTTPWeightSyncClient(server.url, timeout=120),
                source=OwnedSource(full, owner, rank=r),
                group=groups[r],
            )

        threads = [threading.Thread(target=init, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        try:
            two = timed_rounds(engines, rounds + 1)[1:]
        finally:
            for e in engines:
                if e is not None:
                    e.shutdown()
        want = {n: hashlib.sha256(tensor_bytes(t).numpy()).hexdigest() for n, t in full}
        (reply,) = client.weight_checker("checksum")
        ok = all({n: r.get(n) for n in want} == want for r in reply["replica_checksums"])
    for mode, secs in (("1 broadcaster", one), ("2 broadcasters", two)):
        med = statistics.median(secs)
        rows.append(
            {
                "size_mb": round(nbytes / 1e6, 1),
                "mode": mode,
                "median_s": round(med, 4),
                "min_s": round(min(secs), 4),
                "gbps": round(nbytes / med / 1e9, 3),
                "rounds": len(secs),
                "replicas": replicas,
                "checksums_ok": ok,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="4,32,96", help=f"model sizes in MB, of {sorted(SHAPES)}"
    )
    parser.add_argument(
        "--rounds", type=int, default=7, help="timed rounds per mode (after one warm-up)"
    )
    parser.add_argument("--replicas", type=int, default=1, help="reference-server worker replicas")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/weightwire-bench-models"))
    args = parser.parse_args()
    rows = []
    for mb in (int(s) for s in args.sizes.split(",")):
        if mb not in SHAPES:
            parser.error(f"size {mb} not in {sorted(SHAPES)}")
        for row in bench(mb, build(mb, args.cache), args.rounds, args.replicas):
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| model | broadcasters | median s/round | min s | GB/s | ratio to 1 | checksums |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for row in rows:
        base = next(
            r for r in rows if r["size_mb"] == row["size_mb"] and r["mode"] == "1 broadcaster"
        )
        print(
            f"| {row['size_mb']} MB | {row['mode'].split()[0]} | {row['median_s']:.3f} | "
            f"{row['min_s']:.3f} | {row['gbps']:.3f} | {row['median_s'] / base['median_s']:.2f} "
            f"| {'ok' if row['checksums_ok'] else 'MISMATCH'} |"
        )


if __name__ == "__main__":
    main()
