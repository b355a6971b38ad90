"""A tensor-parallel rank other than 0: loads its share of the model, then runs every step that rank 0 sends.

It has no scheduler, sampler or grammar: rank 0 decides each batch and samples from the gathered logits; this
process only takes part in the forward (model/tp_step.py).
"""

from __future__ import annotations

import logging

import torch

from gramserve.config import ServerConfig
from gramserve.gc_pauses import freeze_heap
from gramserve.ipc import exit_when_parent_dies
from gramserve.model.parallel import TPConfig
from gramserve.model.runner import ModelRunner
from gramserve.scheduler.memory import ReqToTokenPool
from gramserve.scheduler.scheduler import runner_config

logger = logging.getLogger(__name__)


def run_tp_worker_process(config: ServerConfig, ready_pipe, tp: TPConfig) -> None:
    """Entry point (multiprocessing spawn) of tensor-parallel rank `tp.rank` > 0."""
    logging.basicConfig(
        level=config.args.log_level.upper(), format=f"%(asctime)s [tp{tp.rank}] %(levelname)s %(message)s"
    )
    exit_when_parent_dies()
    try:
        torch.set_num_threads(config.settings.scheduler_threads)
        runner = ModelRunner(runner_config(config, tp))
        # The same rows as rank 0's slot table; filled from the steps rank 0 sends.
        table = ReqToTokenPool(config.settings.max_running_requests, runner.context_length, runner.device).table
        runner.init_cuda_graphs(table)
    except Exception as exc:  # noqa: BLE001 - reported to the launcher, which exits with it
        logger.exception("tensor-parallel rank %d failed to start", tp.rank)
        ready_pipe.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    freeze_heap(f"tensor-parallel rank {tp.rank}")
    ready_pipe.send({"ok": True})
    runner.follow(table)
    logger.info("rank 0 stopped; exiting")
