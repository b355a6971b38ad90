"""The step channel of tensor parallelism: rank 0 tells the other ranks what each forward runs.

Rank 0 (the driver) schedules, samples and owns the slot table; the other ranks (followers) only run the model. For
every forward the driver sends a `StepHeader` (the host-side lists: lengths, mode) over ZeroMQ, so a follower can
start preparing the step (attention plans, the CUDA graph to replay) while the driver's GPU is still busy with the
previous one, and then broadcasts the step's device tensors (token ids, positions, KV slots, request rows, lengths,
and the slot-table entries of every new token) packed in one int64 tensor over the group's device collective. A
follower writes those slot-table entries into its own copy of the table, rebuilds the ForwardBatch and runs it;
the collectives inside the forward keep the ranks in step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import zmq

from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.parallel import TPGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepHeader:
    """What a follower needs on the host to take part in one forward; None in its place ends the follower."""

    mode: ForwardMode
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    num_tokens: int
    return_all_logits: bool

    @property
    def table_entries(self) -> int:
        """Slot-table entries sent: every position of each request in an extend (a cached prefix's rows were
        written without a forward), the new position in a decode."""
        return sum(self.seq_lens_cpu) if self.mode == ForwardMode.EXTEND else len(self.seq_lens_cpu)

    @property
    def packed_size(self) -> int:
        return 3 * self.num_tokens + 2 * len(self.seq_lens_cpu) + self.table_entries


def _table_cells(mode: ForwardMode, rows: torch.Tensor, seq_lens: torch.Tensor, total: int):
    """(row, column) of the slot-table entries a step sends; built on the device without a host sync."""
    if mode == ForwardMode.DECODE:
        return rows, seq_lens - 1
    per_cell_rows = torch.repeat_interleave(rows, seq_lens, output_size=total)
    starts = torch.repeat_interleave(torch.cumsum(seq_lens, 0) - seq_lens, seq_lens, output_size=total)
    cols = torch.arange(total, device=rows.device) - starts
    return per_cell_rows, cols


class StepSender:
    """Rank 0's end: one PUSH socket per follower (bound on a random port, its address given to the followers
    through the group), then the device broadcast."""

    def __init__(self, tp: TPGroup):
        self.tp = tp
        self.ctx = zmq.Context.instance()
        self.socks: list[zmq.Socket] = []
        endpoints = []
        for _ in range(tp.size - 1):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port("tcp://*" if tp.config.channel_host != "127.0.0.1" else "tcp://127.0.0.1")
            self.socks.append(sock)
            endpoints.append(f"tcp://{tp.config.channel_host}:{port}")
        tp.broadcast_object(endpoints)

    def send(self, batch: ForwardBatch) -> None:
        header = StepHeader(
            batch.mode,
            list(batch.seq_lens_cpu),
            list(batch.extend_prefix_lens_cpu),
            list(batch.extend_seq_lens_cpu),
            int(batch.input_ids.shape[0]),
            batch.return_all_logits,
        )
        for sock in self.socks:
            sock.send_pyobj(header)
        rows, cols = _table_cells(batch.mode, batch.req_pool_indices, batch.seq_lens, header.table_entries)
        parts = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens]
        parts.append(batch.req_to_token[rows, cols])
        self.tp.broadcast(torch.cat([p.to(torch.long) for p in parts]))

    def close(self) -> None:
        for sock in self.socks:
            sock.send_pyobj(None)
            sock.close()


class StepReceiver:
    """A follower's end. Made when the sender is (both take part in one exchange of addresses); `table` (this
    rank's slot table) is set before the first step."""

    def __init__(self, tp: TPGroup, device: torch.device):
        self.tp, self.device = tp, device
        self.table: torch.Tensor | None = None
        endpoints = tp.broadcast_object()
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Rank 0's process may end without a goodbye (SIGTERM, a crash, node 0 stopped): its socket closing is the
        # signal then.
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.sock.connect(endpoints[tp.rank - 1])

    def receive(self) -> ForwardBatch | None:
        """The next step's batch (its slot-table entries already written), or None when rank 0 stops."""
        events = dict(self.poller.poll())
        if self.sock not in events:
            logger.info("rank 0 disconnected")
            return None
        header: StepHeader | None = self.sock.recv_pyobj()
        if header is None:
            return None
        packed = self.tp.broadcast(torch.empty(header.packed_size, dtype=torch.long, device=self.device))
        t, b = header.num_tokens, len(header.seq_lens_cpu)
        input_ids, positions, out_cache_loc, rows, seq_lens, entries = packed.split(
            [t, t, t, b, b, header.table_entries]
        )
        table_rows, cols = _table_cells(header.mode, rows, seq_lens, header.table_entries)
        self.table[table_rows, cols] = entries.to(self.table.dtype)
        return ForwardBatch(
            mode=header.mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            seq_lens_cpu=header.seq_lens_cpu,
            extend_prefix_lens_cpu=header.extend_prefix_lens_cpu,
            extend_seq_lens_cpu=header.extend_seq_lens_cpu,
            req_to_token=self.table,
            return_all_logits=header.return_all_logits,
        )

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
