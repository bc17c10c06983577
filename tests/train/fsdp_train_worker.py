"""Run by tests/train/test_fsdp.py under torchrun: `draftsmith train` under accelerate's FSDP2 on CPUs.

accelerate 1.15 selects FSDP only on accelerators (accelerate/state.py `_prepare_backend`: without
one the distributed type stays NO), which is why train/loop.py refuses the fsdp preset on CPUs.
Here the Accelerator is given the state accelerate gives it on GPUs (FSDP, the plugin of
recipes/accelerate/fsdp.yaml), so the loop's own FSDP path runs for real over gloo: prepare, the
target sharded, accumulation, clipping, checkpoints, final/ gathered from shards, the eval stage."""

import sys

from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

from draftsmith.cli import main
from draftsmith.train import loop


def fsdp_accelerator(cfg):
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="size_based_wrap",
        min_num_params=1000,
        reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT",
    )
    acc = Accelerator(
        cpu=False,
        fsdp_plugin=plugin,
        project_dir=str(cfg.run_dir),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )
    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return acc


if __name__ == "__main__":
    loop.make_accelerator = fsdp_accelerator
    sys.exit(main(["train", *sys.argv[1:]]))
