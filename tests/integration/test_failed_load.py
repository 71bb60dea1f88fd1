"""A model load that fails midway (integration/startup/failed_load.py): the host arena is given back before the
error propagates, even with views of it still alive in the traceback, and the quant config forgets the placement."""

from __future__ import annotations

import gc
import inspect

import pytest
import torch

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.integration import vllm_hooks
from vllm_expert_offload.integration.methods.quant_config import Exl3Config, ProcessState
from vllm_expert_offload.integration.startup import failed_load
from vllm_expert_offload.offload.options import OffloadOptions
from vllm_expert_offload.offload.process import ProcessPlacement
from vllm_expert_offload.offload.rank_plan import ExpertGeometry
from vllm_expert_offload.testing.tiny_models import build_tiny_model

from support.process_maps import is_mapped

GEOMETRY = ExpertGeometry(hidden=128, intermediate=256, intermediate_per_rank=256, tp_rank=0, tp_size=1)


class FakeVllmConfig:
    def __init__(self, quant_config) -> None:
        self.quant_config = quant_config


def test_the_hook_matches_vllms_loader() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    loader = inspect.unwrap(BaseModelLoader.load_model)
    assert tuple(inspect.signature(loader).parameters) == vllm_hooks.FAILED_LOAD.params


def test_a_successful_load_passes_through() -> None:
    quant = Exl3Config.__new__(Exl3Config)
    quant.process = ProcessState()
    quant.process.placement = "kept"
    load = failed_load.wrap_load_model(lambda self, vllm_config, model_config, prefix: ("model", prefix))
    assert load(None, FakeVllmConfig(quant), None, "p") == ("model", "p") and quant.process.placement == "kept"


def test_a_failed_load_releases_the_arena_before_the_error_propagates(tmp_path, arena_log) -> None:
    summary = validate_checkpoint(Exl3Checkpoint.open(build_tiny_model(None, "qwen3_moe")))
    quant = Exl3Config.__new__(Exl3Config)
    quant.process = ProcessState()
    quant.process.placement = None
    made, kept = [], []

    def loading_that_fails(self, vllm_config, model_config, prefix):
        placement = ProcessPlacement(OffloadOptions(host_fraction=0.5, record_stats=tmp_path / "stats.json"), summary,
                                     GEOMETRY, 2, torch.device("cpu"))
        vllm_config.quant_config.process.placement = placement
        view = placement.arena.view(placement.arena.reserve(4096), (4096,), torch.uint8).fill_(7)
        made.append(placement)
        kept.append(view)  # a view that outlives the failure (as one in a traceback's frames would)
        raise Exl3FormatError("model.layers.1.mlp.experts.5.down_proj.suh: missing")

    load = failed_load.wrap_load_model(loading_that_fails)
    with pytest.raises(Exl3FormatError, match="down_proj.suh: missing"):
        load(None, FakeVllmConfig(quant), None, "")
    (placement,) = made
    base = placement.arena.device_address(0)
    assert quant.process.placement is None and not placement._exit_save.still_active()
    assert arena_log.text.count("host arena released: ") == 1
    assert ("its pages freed (live views read zeros; unmapped with the last) (the model load failed: "
            "Exl3FormatError: model.layers.1.mlp.experts.5.down_proj.suh: missing)") in arena_log.text
    assert is_mapped(base) and int(kept[0].sum()) == 0
    placement.arena.close()  # nothing left to do: released once
    del kept[:], made[:], placement
    gc.collect()
    assert not is_mapped(base) and arena_log.text.count("host arena released: ") == 1
