"""Tensor parallelism: one model split across N processes by its heads (Megatron-LM's split).

Each rank holds 1/N of every layer's attention heads and MLP columns, and the keys and values
of its own KV heads only. The split needs two all-reduces a layer and nothing else:

- q, k and v (and gate and up) are *column-parallel*: rank r computes its heads' columns from
  the whole hidden state, which every rank has;
- o and down are *row-parallel*: rank r multiplies its heads' (or columns') slice of the input
  by its rows of the weight, a partial sum of the full product; an all-reduce adds the N
  partial sums, so every rank leaves the layer with the whole hidden state again.

The embedding, the norms and the LM head are replicated: every rank embeds the tokens itself
(no communication), and rank 0 alone computes logits and samples, so no rank ever gathers
logits. (Splitting the vocabulary, as vLLM does, saves their memory on large-vocabulary
models at the price of an all-gather of the logits each step.)

Every rank's cache has the same blocks, ids and slots: one scheduler, on rank 0, decides a
step; :class:`TensorParallelExecutor` sends it to the workers (as vLLM's executor broadcasts
its scheduler output), each rank runs its shard over its own cache, and rank 0 samples.
Processes meet through torch.distributed: gloo on CPUs, NCCL on GPUs. By default the engine
starts its workers itself, on this machine, with a TCP rendezvous on the loopback address.

Across machines, start each process yourself with torch.distributed's environment variables.
Every process gets the same ``MASTER_ADDR`` (the engine's machine), ``MASTER_PORT`` and
``WORLD_SIZE`` (the tensor-parallel size), and its own ``RANK``. Rank 0 is the engine:
``LLM(model, tensor_parallel_size=N, distributed_init_method="env://")``, or
``python -m pagedlab.serve --tensor-parallel-size N --distributed-init-method env://``.
Ranks 1 to N - 1 are workers: ``python -m pagedlab.engine.tensor_parallel`` (:func:`main`).
A worker needs no model: rank 0 sends it the weights and the cache's layout once the group is
formed. The engine waits up to its timeout for every rank to join; a missing, malformed or
inconsistent variable is refused with an error naming it. The engine listens on
``MASTER_PORT`` on every network the machine is on, with no authentication: use a private
network. If gloo picks the wrong network interface, set ``GLOO_SOCKET_IFNAME`` (NCCL:
``NCCL_SOCKET_IFNAME``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
import traceback
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from pagedlab.engine.sequence import Sequence
from pagedlab.engine.step import Chunk, Step, StepOutput
from pagedlab.model import ModelArgs, PagedLlama

DEFAULT_TIMEOUT = 120.0  # seconds a step may wait on a rank before the engine gives up
# How long a worker waits for rank 0's next step: an idle engine (a server with no requests)
# sends none, and a worker that gave up after DEFAULT_TIMEOUT would fail the next request.
IDLE_TIMEOUT = datetime.timedelta(days=7)


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank died or stopped answering; names it. The engine is shut down."""


def shard_args(args: ModelArgs, world: int) -> ModelArgs:
    """One rank's shape: ``1/world`` of the query heads, KV heads and MLP columns."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(args, name) % world:
            raise ValueError(
                f"tensor_parallel_size={world} must divide the model's {name}="
                f"{getattr(args, name)} (pagedlab does not replicate KV heads: each rank holds "
                "whole heads of its own)"
            )
    return replace(args, num_heads=args.num_heads // world,
                   num_kv_heads=args.num_kv_heads // world,
                   intermediate_size=args.intermediate_size // world)


def shard_state_dict(state: dict[str, Tensor], args: ModelArgs, rank: int,
                     world: int) -> dict[str, Tensor]:
    """Rank ``rank``'s weights: its rows of the column-parallel matrices (q, k and v stacked,
    gate, up), its columns of the row-parallel ones (o, down); the rest whole."""
    d = args.head_dim
    q, kv = args.num_heads * d, args.num_kv_heads * d

    def part(t: Tensor, size: int, dim: int = 0) -> Tensor:  # rank's slice of ``size`` / world
        step = size // world
        return t.narrow(dim, rank * step, step)

    out = {}
    for name, t in state.items():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            wq, wk, wv = t.split([q, kv, kv])
            out[name] = torch.cat([part(wq, q), part(wk, kv), part(wv, kv)]).contiguous()
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = part(t, t.shape[0]).contiguous()
        elif name.endswith("o_proj.weight"):
            out[name] = part(t, q, dim=1).contiguous()
        elif name.endswith("down_proj.weight"):
            out[name] = part(t, t.shape[1], dim=1).contiguous()
        else:
            out[name] = t
    return out


class RowParallelLinear(nn.Module):
    """A row-parallel layer: this rank's partial product, summed over the ranks."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> Tensor:
        return self.linear.weight

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        dist.all_reduce(out)  # the ranks' partial sums added: the whole product on each
        return out


def build_shard(args: ModelArgs, state: dict[str, Tensor], rank: int, world: int,
                kernels: str, dtype: torch.dtype, device) -> PagedLlama:
    """Rank ``rank``'s model: its weights loaded into a model of its shape, the row-parallel
    layers wrapped to all-reduce."""
    with torch.device("meta"):
        model = PagedLlama(shard_args(args, world), kernels=kernels)
    model.load_state_dict(shard_state_dict(state, args, rank, world), assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj)
    return model.to(device=device, dtype=dtype).eval()


def portable(step: Step) -> Step:
    """What a worker needs of ``step`` to run it: each chunk's tokens, positions, slots and
    block table, and the block copies; no request, parameter or generator."""
    def chunk(c: Chunk) -> Chunk:
        seq = Sequence(c.seq.seq_id, c.seq.token_ids[:c.context_len - len(c.draft)])
        return Chunk(seq, c.start, c.num_tokens, c.block_table, c.slots, c.is_sampled, c.draft)

    return Step(prefills=[chunk(c) for c in step.prefills],
                decodes=[chunk(c) for c in step.decodes],
                swap_out=step.swap_out, swap_in=step.swap_in, copies=step.copies,
                num_draft_tokens=step.num_draft_tokens)


def worker_loop(rank: int, world: int, init_method: str, timeout: float, build: dict,
                progress) -> None:
    """A spawned worker rank's life: join the group, then :func:`_run_steps`.
    ``progress[rank]`` counts the steps received, so rank 0 can tell which rank a stalled step
    waits for."""
    steps = _join(build["device"], init_method, rank, world, timeout)

    def took_step() -> None:
        progress[rank] += 1

    _run_steps(rank, world, build, steps, took_step)


def _run_steps(rank: int, world: int, build: dict, steps, took_step) -> None:
    """Build this rank's shard and cache, then run every step rank 0 sends (on the group
    ``steps``) until it sends None; ``took_step()`` after each step is received. Leaves the
    group at the end."""
    from pagedlab.engine.runner import ModelRunner

    try:
        model = build_shard(build["args"], build["state"], rank, world, build["kernels"],
                            build["dtype"], build["device"])
        runner = ModelRunner(model, *build["cache"])
        runner.samples = False
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=steps)
            if box[0] is None:
                break
            took_step()
            runner.execute(box[0])
    finally:
        dist.destroy_process_group()


def _join(device: str, init_method: str | None, rank: int, world: int, timeout: float,
          store=None):
    """Join the group of ``world`` ranks as ``rank`` (at ``init_method``, or through
    ``store``): NCCL on CUDA, gloo on a CPU. The all-reduces wait on a rank for ``timeout``
    seconds. Returns a second group, gloo's, that carries the steps. Its timeout is each
    process's own: rank 0 waits ``timeout`` to hand a step over, so a stalled rank is still
    found; a worker waits up to IDLE_TIMEOUT for the next step."""
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            init_method=init_method, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    wait = datetime.timedelta(seconds=timeout) if rank == 0 else IDLE_TIMEOUT
    return dist.new_group(backend="gloo", timeout=wait)


def _end(procs) -> None:
    """Wait a little for each process to leave, then kill it: none is left running."""
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
_KEY = "pagedlab/"  # the keys the engine and its workers share in the rendezvous's store


def env_rendezvous(environ=None) -> tuple[str, int, int, int]:
    """torch.distributed's environment rendezvous, read and checked before anything listens
    or connects: ``(MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK)``."""
    environ = os.environ if environ is None else environ
    missing = [name for name in ENV_VARS if not environ.get(name, "").strip()]
    if missing:
        raise ValueError(f"set {', '.join(missing)}: the environment rendezvous needs "
                         f"{', '.join(ENV_VARS)} in every process")

    def integer(name: str, low: int, high: int | None, why: str) -> int:
        text = environ[name].strip()
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is not an integer") from None
        if value < low or high is not None and value > high:
            raise ValueError(f"{name}={value}: {why}")
        return value

    port = integer("MASTER_PORT", 1, 65535, "a port is 1 to 65535")
    world = integer("WORLD_SIZE", 2, None, "tensor parallelism needs at least 2 ranks")
    rank = integer("RANK", 0, world - 1, f"ranks are 0 to WORLD_SIZE - 1 = {world - 1}")
    return environ["MASTER_ADDR"].strip(), port, world, rank


class _StoreProgress:
    """Steps each worker has received, counted in the rendezvous's store (the spawned
    workers' shared array, for workers on other machines)."""

    def __init__(self, store):
        self.store = store

    def __getitem__(self, rank: int) -> int:
        return self.store.add(f"{_KEY}progress/{rank}", 0)

    def took_step(self, rank: int) -> None:
        self.store.add(f"{_KEY}progress/{rank}", 1)


def main(argv=None, environ=None) -> int:
    """A worker rank started apart from the engine, on this machine or another: read the
    environment rendezvous, join rank 0's group, receive the model, run steps until rank 0
    ends. Exit status 0 when rank 0 shut the engine down, 1 with a message otherwise."""
    argparse.ArgumentParser(
        prog="python -m pagedlab.engine.tensor_parallel",
        description="A tensor-parallel worker of a pagedlab engine that runs elsewhere. Set "
                    "MASTER_ADDR and MASTER_PORT (where the engine, rank 0, listens), "
                    "WORLD_SIZE (the tensor-parallel size) and RANK (1 to WORLD_SIZE - 1). "
                    "On CUDA, LOCAL_RANK picks this machine's GPU (default 0).").parse_args(argv)
    environ = os.environ if environ is None else environ
    try:
        addr, port, world, rank = env_rendezvous(environ)
        if rank == 0:
            raise ValueError("RANK=0 is the engine's (the process that builds LLM with "
                             "distributed_init_method='env://'); a worker is 1 to "
                             f"WORLD_SIZE - 1 = {world - 1}")
        try:
            store = dist.TCPStore(addr, port, None, is_master=False,
                                  timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT))
            engines_world = int(store.get(_KEY + "world"))
            device = store.get(_KEY + "device").decode()
            timeout = float(store.get(_KEY + "timeout"))  # the engine's, for every wait
        except Exception as error:  # noqa: BLE001  (the store says only that it timed out)
            raise ValueError(f"no pagedlab engine answered at MASTER_ADDR={addr} "
                             f"MASTER_PORT={port} within {DEFAULT_TIMEOUT:g} s "
                             f"({error})") from None
        if engines_world != world:
            raise ValueError(f"WORLD_SIZE={world} but the engine at {addr}:{port} runs "
                             f"tensor_parallel_size={engines_world}")
        if store.add(f"{_KEY}rank/{rank}", 1) > 1:
            raise ValueError(f"RANK={rank} has already joined the engine at {addr}:{port}: "
                             "give each worker its own rank")
    except ValueError as error:
        print(f"pagedlab worker: {error}", file=sys.stderr)
        return 1
    if device == "cuda":
        device = f"cuda:{int(environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    progress = _StoreProgress(store)
    try:
        steps = _join(device, None, rank, world, timeout, store=store)
        box = [None]
        dist.broadcast_object_list(box, src=0, group=steps)
        _run_steps(rank, world, dict(box[0], device=device), steps,
                   lambda: progress.took_step(rank))
    except Exception as error:  # noqa: BLE001  (the engine failed or went away: say so, end)
        print(f"pagedlab worker rank {rank}: the group at {addr}:{port} ended: {error}",
              file=sys.stderr)
        return 1
    return 0


class TensorParallelExecutor:
    """Rank 0's side: starts the workers, sends each step, runs rank 0's shard (``runner``,
    over a model from :func:`build_shard`) and samples. Any failure of a rank fails the step
    with :class:`WorkerFailed` naming it, after every process has been ended.

    ``args`` and ``state`` are the whole model's shape and weights, from which each worker
    cuts its shard; ``cache`` holds the :class:`~pagedlab.engine.runner.ModelRunner` arguments
    after the model (block size, GPU and CPU blocks, cache dtype, scale, decode batch sizes),
    the same on every rank so that every rank lays a step out alike.
    """

    def __init__(self, runner, args: ModelArgs, state: dict[str, Tensor], world: int,
                 cache: tuple, timeout: float | None = None,
                 distributed_init_method: str | None = None):
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process: "
                               "shut it down first (LLM.shutdown())")
        timeout = timeout or DEFAULT_TIMEOUT
        self.runner, self.world, self.timeout, self.num_steps = runner, world, timeout, 0
        self.closed = True  # until every rank has joined
        self.workers, self.store = [], None  # spawned processes; the env rendezvous's store
        self.steps = None  # the group the steps go out on (see _join); set once this engine
        # has formed the process's group, which is then its to destroy
        model = runner.model
        build = dict(args=args, state=state, kernels=model.kernels, dtype=model.dtype,
                     device=str(model.device), cache=cache)
        if distributed_init_method == "env://":
            self._join_env(build)
            return
        if distributed_init_method is not None:
            raise ValueError(f"distributed_init_method={distributed_init_method!r}: None (the "
                             "engine starts its workers) or 'env://' (they are started apart)")
        self.port = _free_port()
        init_method = f"tcp://127.0.0.1:{self.port}"
        ctx = mp.get_context("spawn")
        self.progress = ctx.Array("q", world, lock=False)
        self.workers = [ctx.Process(target=worker_loop, daemon=True, name=f"pagedlab-tp{rank}",
                                    args=(rank, world, init_method, timeout, build,
                                          self.progress))
                        for rank in range(1, world)]
        for worker in self.workers:
            worker.start()
        try:
            self.steps = _join(str(model.device), init_method, 0, world, timeout)
        except Exception as error:
            raise self._failure(error) from error
        self.closed = False

    def _join_env(self, build: dict) -> None:
        """Rank 0 of a group whose workers were started apart (:func:`main`): listen on
        ``MASTER_PORT``, say there what the workers must agree with, wait for every rank to
        join, and send them the model."""
        addr, port, world, rank = env_rendezvous()
        if rank != 0:
            raise ValueError(f"RANK={rank}: the engine is rank 0; start ranks 1 to "
                             f"{world - 1} with python -m pagedlab.engine.tensor_parallel")
        if world != self.world:
            raise ValueError(f"WORLD_SIZE={world} but tensor_parallel_size={self.world}: "
                             "they must be equal")
        self.port = port
        try:
            self.store = dist.TCPStore(addr, port, world, is_master=True,
                                       timeout=datetime.timedelta(seconds=self.timeout),
                                       wait_for_workers=False)
        except Exception as error:
            raise RuntimeError(f"cannot listen on MASTER_PORT={port}: {error}") from error
        device = torch.device(build["device"]).type
        self.store.set(_KEY + "world", str(world))
        self.store.set(_KEY + "device", device)
        self.store.set(_KEY + "timeout", str(self.timeout))
        self.progress = _StoreProgress(self.store)
        try:
            self.steps = _join(device, None, 0, world, self.timeout, store=self.store)
            cpu_state = {name: t.cpu() for name, t in build["state"].items()}
            dist.broadcast_object_list([dict(build, state=cpu_state)], src=0, group=self.steps)
        except Exception as error:
            traceback.clear_frames(error.__traceback__)  # its frames hold the group's store
            missing = [f"rank {r} did not join" for r in range(1, world)
                       if not self.store.add(f"{_KEY}rank/{r}", 0)]
            self.closed = True
            self.shutdown()
            what = "; ".join(missing) or f"the group failed: {error}"
            raise WorkerFailed(f"tensor parallelism of {world} at {addr}:{port}: {what} "
                               f"(within {self.timeout:g} s); the engine is shut down") from error
        self.closed = False

    def execute(self, step: Step) -> StepOutput:
        if self.closed:
            raise WorkerFailed("the tensor-parallel engine is shut down")
        if step.is_empty:
            return StepOutput([])
        self.num_steps += 1
        try:
            dist.broadcast_object_list([portable(step)], src=0, group=self.steps)
            return self.runner.execute(step)
        except Exception as error:
            raise self._failure(error) from error

    def _failure(self, error: Exception) -> WorkerFailed:
        """Which ranks failed (died, or never received the step), every process ended."""
        traceback.clear_frames(error.__traceback__)  # its frames hold the group (and store)
        deadline = time.monotonic() + 2.0  # a rank killed a moment ago may not be reaped yet,
        while time.monotonic() < deadline and (  # nor one started apart have counted the step
                all(w.exitcode is None for w in self.workers) if self.workers
                else any(self.progress[r] < self.num_steps for r in range(1, self.world))):
            time.sleep(0.05)
        dead = [f"rank {rank} died (exit code {w.exitcode})"
                for rank, w in enumerate(self.workers, 1) if w.exitcode is not None]
        alive = [rank for rank in range(1, self.world)  # of the workers started apart: all
                 if rank > len(self.workers) or self.workers[rank - 1].exitcode is None]
        stalled = [f"rank {rank} did not take step {self.num_steps}"
                   for rank in alive if self.progress[rank] < self.num_steps]
        self.closed = True  # no goodbye: a rank that failed would not hear it
        self.shutdown()
        what = "; ".join(dead + stalled) or f"a collective failed: {error}"
        return WorkerFailed(f"tensor parallelism of {self.world}: {what} (within "
                            f"{self.timeout:g} s); the engine is shut down")

    def shutdown(self) -> None:
        """End the workers (asked first, then killed) and leave the group: no process and no
        port left behind."""
        if not self.closed and all(w.is_alive() for w in self.workers):
            try:
                dist.broadcast_object_list([None], src=0, group=self.steps)
            except Exception:  # noqa: BLE001  (a rank is gone: it is killed below)
                pass
        self.closed = True
        _end(self.workers)
        if self.steps is not None and dist.is_initialized():  # never another engine's group
            dist.destroy_process_group()
        self.steps = None
        if self.store is not None:  # the env rendezvous's port closes with its store
            self.store = self.progress = None


def _allreduce_loop(rank: int, world: int, init_method: str, sizes: list[int], repeats: int,
                    results) -> None:
    """One rank of :func:`measure_allreduce`: ``repeats`` timed all-reduces of each size."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT))
    try:
        tensors = {n: torch.ones(max(1, n // 4)) for n in sizes}  # fp32, as a CPU engine sends
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for i in range(repeats + 3):  # the sizes interleaved, so that a slow moment hits all
            for nbytes, x in tensors.items():
                dist.barrier()  # every rank starts together: no wait for a late one is timed
                start = time.perf_counter()
                dist.all_reduce(x)
                if i >= 3:  # the first rounds warm the ring's buffers up
                    times[nbytes].append(time.perf_counter() - start)
        if rank == 0:
            results.put(times)
    finally:
        dist.destroy_process_group()


def measure_allreduce(world: int, sizes, repeats: int = 20,
                      timeout: float = DEFAULT_TIMEOUT) -> dict[int, list[float]]:
    """Seconds each of ``repeats`` gloo all-reduces of each of ``sizes`` bytes (fp32) took on
    rank 0 of ``world`` fresh processes on this machine, as rank 0 of the engine sees them
    (transfer, and any wait for a slower rank). The processes are this call's own, so an
    engine running in this process is left alone."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_allreduce_loop, daemon=True, name=f"pagedlab-ar{rank}",
                         args=(rank, world, init_method, [int(n) for n in sizes], repeats,
                               results))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        return results.get(timeout=timeout)
    finally:
        _end(procs)


__all__ = ["ENV_VARS", "RowParallelLinear", "TensorParallelExecutor", "WorkerFailed",
           "build_shard", "env_rendezvous", "main", "measure_allreduce", "shard_args",
           "shard_state_dict", "worker_loop"]


if __name__ == "__main__":
    sys.exit(main())
