"""Per-client tensors that live across rounds (the personal bank: personal parameters and per-client constants;
the algorithm's client state), at the cost of the clients that trained: a client's row exists once it was written;
every other client reads the shared initial value. Rows live on the host, in a file past a memory budget; a
cohort's rows travel to its device and back."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Tensors = dict[str, torch.Tensor]


class ClientBank(nn.Module):
    """Named per-client tensors: `init[name]` for every client, `rows[name][slot]` for the clients written so far
    (`slot` maps a client id to its row). Rows are on the host; past `budget_bytes` they are memory-mapped from a
    file. The module's state (in its state_dict, through extra state) is the written rows only; `since_saved`
    names the clients written since the last `take_changes()`, so checkpoints can write just those."""

    def __init__(self, init: Tensors, n_clients: int, budget_bytes: int | None = None):
        super().__init__()
        self.names, self.n_clients, self.budget_bytes = list(init), n_clients, budget_bytes
        self.init = {n: v.detach().to("cpu").clone() for n, v in init.items()}
        self.rows: Tensors = {n: v.new_empty((0, *v.shape)) for n, v in self.init.items()}
        self.slot: dict[int, int] = {}
        self.since_saved: set[int] = set()
        self.chain: list[str] | None = None  # files of the incremental saves, when checkpoints save changes

    # ---- reading and writing --------------------------------------------------------------------------------------
    def get(self, clients: torch.Tensor) -> Tensors:
        """The rows of `clients` [K, ...] on the clients tensor's device (written rows, else the initial value)."""
        if not self.names:
            return {}
        ids = clients.tolist()
        slots = torch.tensor([self.slot.get(c, -1) for c in ids], dtype=torch.long)
        written = slots >= 0
        out = {}
        for n in self.names:
            value = self.init[n].expand(len(ids), *self.init[n].shape).clone()
            if bool(written.any()):
                value[written] = self.rows[n][slots[written]]
            out[n] = value.to(clients.device, non_blocking=True)
        return out

    def put(self, clients: torch.Tensor, values: Tensors) -> None:
        """Write the rows of `clients` (allocating rows for clients written for the first time)."""
        if not self.names:
            return
        ids = clients.tolist()
        for c in ids:
            if c not in self.slot:
                self.slot[c] = len(self.slot)
        self._reserve(len(self.slot))
        slots = torch.tensor([self.slot[c] for c in ids], dtype=torch.long)
        for n in self.names:
            self.rows[n][slots] = values[n].detach().to("cpu", self.rows[n].dtype)
        self.since_saved.update(ids)

    def _reserve(self, count: int) -> None:
        """Room for `count` rows: capacity doubles; past the budget the rows move to a memory-mapped file."""
        capacity = len(next(iter(self.rows.values())))
        if count <= capacity:
            return
        capacity = max(count, 2 * capacity, 8)
        for n in self.names:
            grown = self._storage(n, capacity)
            grown[: len(self.rows[n])] = self.rows[n]
            self.rows[n] = grown

    def _storage(self, name: str, capacity: int) -> torch.Tensor:
        """An empty [capacity, ...] tensor for `name`: in memory, or past the budget backed by a file."""
        like = self.init[name]
        shape = (capacity, *like.shape)
        if self.budget_bytes is None or self._bytes_at(capacity) <= self.budget_bytes:
            return like.new_empty(shape)
        handle, path = tempfile.mkstemp(prefix=f"fedpilot-bank-{name}-")
        os.close(handle)
        try:
            rows = torch.from_file(path, shared=True, size=capacity * like.numel(), dtype=like.dtype)
        finally:  # the mapping outlives its name: nothing stays on disk once the rows are freed, even after a kill
            os.unlink(path)
        return rows.view(shape)

    def _bytes_at(self, capacity: int) -> int:
        return sum(capacity * v.numel() * v.element_size() for v in self.init.values())

    def tensor(self, name: str) -> torch.Tensor:
        """The dense value [n_clients, ...] of every client (small federations: tests, reports)."""
        return self.get(torch.arange(self.n_clients))[name]

    def nbytes(self) -> int:
        """Bytes of the written rows and the initial values."""
        return self._bytes_at(len(self.slot)) + sum(v.numel() * v.element_size() for v in self.init.values())

    @property
    def written(self) -> int:
        """Clients with a row of their own."""
        return len(self.slot)

    # ---- state: the written rows, whole or as the changes since the last save -------------------------------------
    def snapshot(self, clients: list[int] | None = None) -> dict[str, Any]:
        """The rows of `clients` (default: every written client) as plain tensors."""
        ids = sorted(self.slot) if clients is None else sorted(clients)
        slots = torch.tensor([self.slot[c] for c in ids], dtype=torch.long)
        return {"clients": torch.tensor(ids, dtype=torch.long), "rows": {n: self.rows[n][slots].clone()
                                                                          for n in self.names}}

    def take_changes(self) -> dict[str, Any]:
        """The rows written since the last call, and forget them (what an incremental checkpoint writes)."""
        changes = self.snapshot(list(self.since_saved))
        self.since_saved.clear()
        return changes

    def save_changes(self, path: Path, write: bool = True) -> None:
        """Save the rows written since the last save to `path` and add it to the chain (`write=False`: another
        process writes it). A second save at the same path (two checkpoints of one step) adds nothing."""
        self.chain = self.chain or []
        if self.chain and self.chain[-1] == str(path):
            return
        changes = self.take_changes()
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(changes, path)
        self.chain.append(str(path))

    def keep_changes(self, on: bool) -> None:
        """Checkpoints save this bank as the chain of its changes (on), or as every written row."""
        self.chain = (self.chain or []) if on else None

    def apply(self, saved: dict[str, Any]) -> None:
        """Write the rows of a snapshot (or a change)."""
        if len(saved["clients"]):
            self.put(saved["clients"], saved["rows"])

    def get_extra_state(self) -> dict[str, Any]:
        return {"changes": list(self.chain)} if self.chain is not None else self.snapshot()

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """A snapshot, or {"changes": [files]}: the chain of incremental saves replayed on the initial rows."""
        for change in ([torch.load(f, weights_only=True) for f in state["changes"]] if "changes" in state
                       else [state]):
            self.apply(change)
        self.since_saved.clear()
        if "changes" in state:  # a resumed stage goes on with the chain it was saving
            self.chain = list(state["changes"])

    # ---- several processes ------------------------------------------------------------------------------------------
    def share_rows(self, clients: torch.Tensor, mine: slice) -> None:
        """DDP: this process wrote the rows `clients[mine]`, the others the rest of `clients`; afterwards every
        process holds all of them (a sum over processes of disjoint rows, exact)."""
        if not self.names:
            return
        values = self.get(clients)
        for n in self.names:
            rows = torch.zeros_like(values[n])
            rows[mine] = values[n][mine]
            dist.all_reduce(rows)
            values[n] = rows
        self.put(clients, values)


def save_changes(banks: dict[str, ClientBank], folder: Path, step: int, write: bool, state: dict[str, Any],
                 prefix: str = "") -> None:
    """Each of a stage's `banks` (by attribute name) saves its rows written since the last save as the next link of
    its chain in `folder` (`write=False`: another process writes it); the checkpoint's `state` names the chain (the
    stage's modules under `prefix`)."""
    for name, bank in banks.items():
        bank.save_changes(folder / f"{name}-{step}.pt", write)
        state[f"{prefix}{name}._extra_state"] = bank.get_extra_state()


def starting_bank(init: Tensors, n_clients: int, carried: ClientBank | None = None,
                  budget_bytes: int | None = None) -> ClientBank:
    """A stage's starting bank: the initial values, with the rows of `carried` (the previous stage's bank) for the
    names it has."""
    bank = ClientBank(init, n_clients, budget_bytes)
    if carried is not None and carried.written:
        common = [n for n in bank.names if n in carried.names]
        saved = carried.snapshot()
        if common:
            rows = {n: saved["rows"][n] if n in common else init[n].expand(len(saved["clients"]), *init[n].shape)
                    for n in bank.names}
            bank.apply({"clients": saved["clients"], "rows": rows})
    bank.since_saved.clear()
    return bank


def starting_values(model: nn.Module, personal_names: list[str], constants: Iterable[str] = ()) -> Tensors:
    """A stage's starting value of each client's own values, as `model` holds them: its personal parameters and its
    per-client constants (buffers of the model, Algorithm.constants)."""
    buffers = dict(model.named_buffers())
    missing = sorted(set(constants) - set(buffers))
    if missing:
        raise ValueError(f"per-client constants {missing} are not buffers of the model: Algorithm.constants names "
                         "buffers that the algorithm's prepare_model registers")
    params = dict(model.named_parameters())
    own = [(n, params[n]) for n in personal_names] + [(n, buffers[n]) for n in sorted(constants)]
    return {n: v.detach().clone() for n, v in own}


def carry_bank(previous: ClientBank, model: nn.Module, names: list[str], budget_bytes: int | None = None) -> ClientBank:
    """The starting personal bank, with `names` (personal parameters and per-client constants), of the stage after
    the one whose personal bank is `previous`, on `model` as that stage left it: a name personal before keeps each
    client's value (and its starting value for clients that never trained), a parameter that becomes personal
    starts as its current shared value (Pillutla et al., ICML 2022, App. B.2), and one new to the model (an adapter
    inserted since, a constant's buffer) as the model's own value."""
    current = {n: p.detach() for n, p in [*model.named_parameters(), *model.named_buffers()]}
    init = {n: previous.init[n] if n in previous.names else current[n] for n in names}
    return starting_bank(init, previous.n_clients, previous, budget_bytes)
