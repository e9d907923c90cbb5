"""Send a Linen variables dict: the reference Qwen3-MoE decoder with scanned layers.

A Linen model's ``init`` returns ``{"params": {...}}``; that dict (or its ``"params"``
entry, or a live getter of either) is the source. With ``nn.scan`` every parameter
carries a leading layer axis and an expert kernel is ``[layers, experts, in, out]``;
the preset cuts one HF tensor per (layer, expert) on device, one jitted call per layer.

    python examples/linen_params_source.py [--model-dir HF_QWEN3_MOE_DIR] [--server URL]

With ``--model-dir`` the weights come from a Hugging Face Qwen3-MoE checkpoint
(``load_decoder``: the preset run backwards), else from a random init.
"""

from __future__ import annotations

import jax
from _send import parser, report_and_send

from weightwire import PytreeSource, load_decoder
from weightwire.tools.models import decoder


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model-dir", help="a Hugging Face qwen3_moe directory")
    args = ap.parse_args(argv)
    if args.model_dir:
        cfg, variables = load_decoder(args.model_dir, scan_layers=True)
    else:
        cfg = decoder.DecoderConfig.for_family(
            "qwen3_moe", num_experts=8, moe_intermediate_size=32, head_dim=16, scan_layers=True
        )
        variables = decoder.init(jax.random.key(0), cfg)
    state = {"variables": variables}  # a training loop replaces this each step
    source = PytreeSource(lambda: state["variables"], decoder.naming(cfg))
    report_and_send(source, args, "linen dict")
    kernel = variables["params"]["model"]["layers"]["mlp"]["experts"]["gate_proj"]["kernel"]
    sent = dict(source)["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert (sent == kernel[1, 3].T).all()
    print(
        f"ok: stacked expert kernel {list(kernel.shape)} -> per-expert HF tensors "
        f"{list(sent.shape)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
