"""Run inside a ``weightwire[jax]``-only virtual environment (no torch installed):
load a tiny HF checkpoint with ``load_decoder`` and push it, changed, to a reference
server in one verified round. Prints one JSON line; the test asserts on it."""

import json
import sys

import jax

from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side import JAXTrainerEngine, PytreeSource
from weightwire.tools.models import decoder
from weightwire.tools.models.loading import load_decoder
from weightwire.trainer import TrainerInitInfo

url, model_dir = sys.argv[1], sys.argv[2]
cfg, params = load_decoder(model_dir)
params = jax.tree.map(lambda p: p * 2, params)  # every nonzero tensor changes
client = HTTPWeightSyncClient(url, timeout=120.0)
engine = JAXTrainerEngine.trainer_init(
    TrainerInitInfo(backend="weightwire_tcp", verify=True),
    client=client,
    source=PytreeSource(lambda: params, decoder.naming(cfg)),
)
metrics = engine.send_weights(
    weight_version="jax-only-1"
)  # verify=True: raises unless every sha256 matches
engine.shutdown()
client.close()
print(
    json.dumps(
        {
            "version": metrics.version,
            "tensors": metrics.tensors,
            "nbytes": metrics.nbytes,
            "torch_modules": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
        }
    )
)
