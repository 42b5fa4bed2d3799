"""Megatron-style tensor parallelism for one verifier replica spread over several devices.

Each rank holds a slice of every attention and MLP block: q/k/v and gate/up are column-parallel (whole
heads, a slice of the intermediate features), o/down are row-parallel and summed over the group, so
every rank leaves each block with the full hidden state. Embedding, norms and lm_head are replicated.
A rank's KV cache holds only its own KV heads, which is what makes a larger model or a longer cache fit.

An unchanged `Engine` runs on rank 0 against a `TensorParallelDriver`; every other rank runs `follow`,
which replays each forward the driver makes (same ids, positions, slots) on its own cache shard, so the
shards stay in step: the engine rolls back by moving lengths only, which needs no message.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from services.layers import MLP, Attention, RaggedLayout
from services.loader import unfilled
from services.model import CausalLM, ForwardOutput


@dataclass(frozen=True, slots=True)
class Groups:
    compute: dist.ProcessGroup  # the all-reduces of the forward (NCCL on CUDA, else gloo)
    meta: dist.ProcessGroup  # gloo: the driver's per-call messages, pickled Python objects on the CPU


def init_group(rank: int, world: int, address: str, timeout: timedelta | None = None) -> Groups:
    """Join the replica's process group; every rank calls it. `address` is "host:port" of rank 0.

    NCCL cannot carry pickled objects cheaply, so the metadata always travels over a separate gloo group."""
    cuda = torch.cuda.is_available()
    kw = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend="nccl" if cuda else "gloo", init_method=f"tcp://{address}", rank=rank,
                            world_size=world, **kw)
    compute = dist.group.WORLD
    meta = dist.new_group(backend="gloo", **kw) if cuda else compute
    return Groups(compute=compute, meta=meta)


# ---- sharding -----------------------------------------------------------------------------------
class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_r W_r^T + b: this rank's input slice of a Linear, summed over the group.

    The bias is added once, after the sum, so every rank holds the same bits and stays in lock step."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, group=None):
        super().__init__()
        n = linear.in_features // world
        with unfilled():
            self.linear = nn.Linear(n, linear.out_features, bias=False)
        self.linear.weight = _param(linear.weight[:, rank * n : (rank + 1) * n], linear.weight)
        self.bias = None if linear.bias is None else _param(linear.bias, linear.bias)
        self.world, self.group = world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # [..., d] this rank's partial sum
        if self.world > 1:
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y if self.bias is None else y + self.bias


def _param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    """An own contiguous copy, so the full unsharded tensor can be freed."""
    return nn.Parameter(t.contiguous().clone(), requires_grad=like.requires_grad)


def _column_parallel(linear: nn.Linear, rank: int, world: int) -> None:
    """Keep this rank's block of output features (rows of the weight), in place."""
    n = linear.out_features // world
    rows = slice(rank * n, (rank + 1) * n)
    linear.weight = _param(linear.weight[rows], linear.weight)  # [n, in]
    if linear.bias is not None:
        linear.bias = _param(linear.bias[rows], linear.bias)  # [n]
    linear.out_features = n


def _check_divisible(model: CausalLM, rank: int, world: int) -> None:
    cfg = model.config
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    for what, n in (("attention heads", cfg.num_attention_heads), ("KV heads", cfg.num_key_value_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % world:
            raise ValueError(f"cannot shard {n} {what} over {world} ranks: {n} is not divisible by {world}")


@torch.no_grad()
def shard_model(model: CausalLM, rank: int, world: int, group=None) -> CausalLM:
    """Shard a loaded model in place for `rank` of `world`; `group` carries the row-parallel all-reduces.

    Rank r keeps query heads [r·H/w, (r+1)·H/w) and KV heads [r·Hkv/w, (r+1)·Hkv/w): since query head h
    reads KV head h // (H/Hkv), the contiguous blocks keep each GQA group whole on one rank. `model.config`
    becomes the local config, so `KVCache(model.config, ...)` allocates this rank's KV heads only."""
    _check_divisible(model, rank, world)
    cfg = model.config
    for layer in model.model.layers:
        attn: Attention = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            _column_parallel(proj, rank, world)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world, group)
        attn.n_heads, attn.n_kv = cfg.num_attention_heads // world, cfg.num_key_value_heads // world
        mlp: MLP = layer.mlp
        _column_parallel(mlp.gate_proj, rank, world)
        _column_parallel(mlp.up_proj, rank, world)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world, group)
    model.config = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world,
                                       num_key_value_heads=cfg.num_key_value_heads // world,
                                       intermediate_size=cfg.intermediate_size // world)
    return model


# ---- driver and followers -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Call:
    """One forward, as rank 0 made it. A follower's cache is named by the driver cache's (S, max_len)."""

    ids: list[int]  # [N]
    positions: list[int]  # [N]
    slots: list[int]  # [R]
    starts: list[int]  # [R]
    lens: list[int]  # [R]
    cache: tuple[int, int]  # (S, max_len)
    drop: tuple[tuple[int, int], ...] = ()  # caches the driver no longer holds: followers free theirs


class TensorParallelDriver:
    """Rank 0's stand-in for `CausalLM` (what `Engine` and `profile_sps` use): each call is first sent
    to the followers, then run on this rank's shard. `group` is the metadata (gloo) group."""

    def __init__(self, model: CausalLM, group):
        self.model, self.group = model, group
        self.config, self.tap_layers = model.config, model.tap_layers
        self._caches: dict[tuple[int, int], weakref.ref] = {}
        self._closed = False

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def prepare_for_serving(self) -> None:
        self.model.prepare_for_serving()

    @property
    def device(self) -> torch.device:
        return self.model.device

    def __call__(self, *args, **kwargs) -> ForwardOutput:
        return self.forward(*args, **kwargs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: RaggedLayout,
                k_cache: torch.Tensor, v_cache: torch.Tensor, logit_rows: torch.Tensor) -> ForwardOutput:
        if self._closed:
            raise RuntimeError("tensor-parallel driver is closed; its followers have stopped")
        key = (k_cache.shape[1], k_cache.shape[3])  # k_cache [L, S, Hkv_local, max_len, Dh]
        call = _Call(input_ids.tolist(), positions.tolist(), list(layout.slots), list(layout.starts),
                     list(layout.lens), key, self._track(key, k_cache))
        _broadcast(call, self.group)
        with torch.inference_mode():
            return self.model(input_ids, positions, layout, k_cache, v_cache, logit_rows)

    def _track(self, key: tuple[int, int], k_cache: torch.Tensor) -> tuple[tuple[int, int], ...]:
        """Followers keep one cache per shape: refuse a second live cache of a shape (the two would
        share one follower cache) and name the shapes whose driver cache is gone, so followers free them."""
        held = self._caches.get(key)
        alive = held() if held is not None else None
        if alive is not None and alive is not k_cache:
            raise RuntimeError(f"a second live KV cache of (slots, max_len) {key}: followers cannot tell them apart")
        self._caches[key] = weakref.ref(k_cache)
        dead = tuple(k for k, ref in self._caches.items() if ref() is None)
        for k in dead:
            del self._caches[k]
        return dead

    def close(self) -> None:
        """Stop the followers (their `follow` returns). Idempotent."""
        if not self._closed:
            self._closed = True
            _broadcast(None, self.group)


def follow(model: CausalLM, group) -> None:
    """The loop of ranks > 0: replay every forward the driver makes, on local caches, until it closes.

    The caches are zeros of this rank's KV heads, allocated the first time a shape is named (like
    `KVCache`); nothing else touches them, just as the engine touches rank 0's only through forwards."""
    cfg, dev = model.config, model.device
    model.prepare_for_serving()  # as the driver's engine does, so every rank runs the same GEMMs
    caches: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    no_rows = torch.empty(0, dtype=torch.long, device=dev)  # [0]: followers want no logits
    with torch.inference_mode():
        while (call := _broadcast(None, group)) is not None:
            for key in call.drop:
                caches.pop(key, None)
            if call.cache not in caches:
                shape = (cfg.num_hidden_layers, call.cache[0], cfg.num_key_value_heads, call.cache[1], cfg.head_dim)
                caches[call.cache] = (torch.zeros(shape, dtype=model.dtype, device=dev),  # [L, S, Hkv, max_len, Dh]
                                      torch.zeros(shape, dtype=model.dtype, device=dev))
            k, v = caches[call.cache]
            layout = RaggedLayout(call.slots, call.starts, call.lens)
            model(torch.tensor(call.ids, dtype=torch.long, device=dev),
                  torch.tensor(call.positions, dtype=torch.long, device=dev), layout, k, v, no_rows)


def _broadcast(call: _Call | None, group) -> _Call | None:
    """Group rank 0's message to every rank of `group` (in place of a received `None`)."""
    box = [call]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
