"""A PyTorch trainer pushes its weights into vLLM after every optimizer step (same API as JAX).

GPU, a stock vLLM >= 0.30 on GPU 1 and the trainer on GPU 0::

    CUDA_VISIBLE_DEVICES=1 VLLM_SERVER_DEV_MODE=1 vllm serve ./qwen2.5-0.5b --port 8000 \\
        --weight-transfer-config '{"backend": "nccl"}' --gpu-memory-utilization 0.5
    CUDA_VISIBLE_DEVICES=0 python examples/torch_trainer_to_vllm.py \\
        --server http://127.0.0.1:8000 --model-dir ./qwen2.5-0.5b --device cuda

CPU (the reference server, or a vLLM started with
``--weight-transfer-config '{"backend": "weightwire_tcp"}'`` and the weightwire plugin)::

    weightwire serve --model tiny-llama --port 8000 &
    python examples/torch_trainer_to_vllm.py --server http://127.0.0.1:8000 --model-dir DIR \\
        --backend weightwire_tcp

Each step trains next-token prediction on one sentence, then ``send_weights()`` streams
``model.named_parameters()`` (``ModuleSource``) to the server; the server's greedy
completion, scored by the local model, shows both sides hold the same weights.
"""

from __future__ import annotations

import argparse

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from weightwire import HTTPWeightSyncClient, ModuleSource, TorchTrainerEngine, TrainerInitInfo

SENTENCE = "The trainer sends fresh weights to the inference server after every step."


@torch.no_grad()
def local_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int]
) -> torch.Tensor:
    ids = torch.tensor([prompt + completion], device=model.device)
    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    return logp.gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--model-dir", required=True, help="the HF directory the server loaded")
    ap.add_argument(
        "--backend", default="nccl", choices=("nccl", "weightwire_nccl", "weightwire_tcp")
    )
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the NCCL backends")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)

    model = AutoModelForCausalLM.from_pretrained(args.model_dir).to(args.device)
    tokens = AutoTokenizer.from_pretrained(args.model_dir)(SENTENCE, add_special_tokens=False)[
        "input_ids"
    ]
    batch = torch.tensor([tokens], device=args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # ready_timeout: a server started beside this script may still be loading (vLLM: minutes).
    client = HTTPWeightSyncClient(args.server, timeout=300, ready_timeout=600)
    device = None
    if args.device.startswith("cuda"):
        device = torch.device(args.device).index or 0  # the NCCL sender's CUDA ordinal
    engine = TorchTrainerEngine.trainer_init(
        TrainerInitInfo(backend=args.backend, device=device),
        client=client,
        source=ModuleSource(model),
    )
    prompt = tokens[:4]
    try:
        for step in range(1, args.steps + 1):
            loss = model(batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            m = engine.send_weights(weight_version=f"step-{step}")
            reply = httpx.post(
                f"{args.server}/v1/completions",
                timeout=120,
                json={
                    "prompt": prompt,
                    "max_tokens": 8,
                    "temperature": 0.0,
                    "logprobs": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            reply.raise_for_status()
            choice = reply.json()["choices"][0]
            mine = local_logprobs(model, prompt, choice["token_ids"])
            diff = float((mine - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().max())
            print(
                f"step {step}: loss {loss.item():.4f}  sync {m.total_seconds * 1e3:.1f} ms  "
                f"{m.nbytes / 1e6:.1f} MB  {m.gbps:.2f} GB/s  server vs torch max |dlogp| "
                f"{diff:.2e}",
                flush=True,
            )
    finally:
        engine.shutdown()
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
