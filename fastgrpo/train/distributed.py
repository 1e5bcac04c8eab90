"""Data-parallel GRPO over torch.distributed: `torchrun --nproc_per_node N -m fastgrpo train ...`.

One process per device (nccl on CUDA, gloo on the CPU; fastgrpo.train.process_group joins them). Each step's
prompts are split into N equal shares of whole groups: a rank generates, scores and trains on its own groups, with the
sampling noise of each sample keyed by its prompt's position in the whole batch (fastgrpo.rollout.sampling.row_keys),
so the rollouts are the ones a single process would draw. Rewards are gathered so that advantages (batch scaling too)
and logged metrics cover the whole batch. Gradients are averaged over ranks by PyTorch's own engines:
- LoRA: DistributedDataParallel over the adapters (the frozen base is replicated), all-reducing once per
  minibatch (no_sync on the other micro-batches); rank 0 writes the checkpoint, which is the same on every rank.
- full fine-tuning: FSDP2 (`fully_shard`) on every decoder layer plus a root group holding the embeddings, final
  norm and lm_head; every rank writes its shard with Distributed Checkpoint. The root group stays gathered from
  the first micro-batch's forward to the minibatch's last backward: the fused loss reads lm_head.weight in every
  chunk, and the gathered weight serves them all, once per optimizer step. For a rollout every group is gathered
  (and hooks told not to reshard) and released after, so the engine decodes with plain tensors and CUDA graphs.

The trainer's loss and log-prob passes call the model's backbone and lm_head.weight directly, never
model.forward, so both engines get a wrapper module (_Policy) whose forward runs those functions: DDP's reducer
and FSDP2's all-gathers see the pass. With one process every method here is the identity and the trainer runs as
it always did.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from fastgrpo.hf.models import architecture, decoder_layers, is_peft_model
from fastgrpo.rollout.base import accepts_prompt_keys
from fastgrpo.train.atomic_folder import atomic_directory
from fastgrpo.train.checkpoint import STATE_FILE, restore_checkpoint, rng_states, set_rng_states, write_run_config
from fastgrpo.train.checkpoint import save_checkpoint as save_plain_checkpoint
from fastgrpo.train.final_export import check_final_exportable, finish_export
from fastgrpo.train.run_dir import RunDirectory
from fastgrpo.train.sharded_state import SHARDS, load_sharded_state, sharded_state
from fastgrpo.train.process_agreement import check_same_checkpoint
from fastgrpo.train.ranks import raised_on_every_process

logger = logging.getLogger(__name__)
# metrics that each rank measures on its own share: combined over ranks (sum, max or mean) for rank 0's log
SUMMED, MAXED, AVERAGED = ("rollout_tokens_per_s", "train_tokens_per_s", "reward_errors"), ("peak_gpu_mem_gib",), \
    ("truncated_frac",)


class _Policy(torch.nn.Module):
    """forward(fn, *args) = fn(model, *args): the module DDP / FSDP2 wrap, so they see grpo_loss and
    sequence_logprobs, which read the backbone and lm_head.weight without calling model.forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def _no_pass(model):
    return None


class _Silent:
    """Stands in for rank 0's metrics log and console on the other ranks: every method does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class Distributed:
    """This process's place in the run (rank, world size) and the collective steps the trainer takes."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size
        self.is_main = rank == 0
        self.active = world_size > 1
        # where small collectives' tensors go: NCCL takes CUDA tensors only
        nccl = self.active and dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._wrappers: dict[int, torch.nn.Module] = {}  # id(model) -> its DDP / FSDP2 _Policy
        self._ddp = self._fsdp = None  # the trained model's wrapper, by kind
        self._fsdp_groups: list[torch.nn.Module] = []  # FSDP2: the trained model's groups, the root first
        self._reshard_layers = True  # FSDP2: layers free their gathered weights after forward
        self._sync_every_micro_batch = True  # FSDP2: reduce-scatter each micro-batch's gradients

    @classmethod
    def current(cls) -> Distributed:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    # ---- set-up ----
    @classmethod
    def wrap(cls, model: torch.nn.Module, ref_model: torch.nn.Module | None, config) -> Distributed:
        """The Distributed of this process, with GRPOConfig `config`'s batch checked against the process count and
        `model` wrapped (data_parallel)."""
        self = cls.current()
        if self.active:
            self.check_sizes(config)
        return self.data_parallel(model, ref_model, config)

    def data_parallel(self, model: torch.nn.Module, ref_model: torch.nn.Module | None, config) -> Distributed:
        """self, with `model` wrapped for data parallelism when there are several processes: DDP for a PEFT (LoRA)
        model, FSDP2 otherwise (the frozen reference copy is sharded too; config's fsdp_* settings where it has
        them). Call before building the optimizer: FSDP2 replaces the parameters by their shards."""
        if not self.active:
            return self
        if is_peft_model(model):
            from torch.nn.parallel import DistributedDataParallel

            # device_ids=None: the module is on one device already and DDP leaves the inputs where they are
            self._ddp = DistributedDataParallel(_Policy(model))
            self._wrappers[id(model)] = self._ddp
        else:
            self._reshard_layers = getattr(config, "fsdp_reshard_after_forward", True)
            self._sync_every_micro_batch = getattr(config, "fsdp_sync_every_micro_batch", True)
            per_group = getattr(config, "fsdp_layers_per_group", 1)
            self._fsdp = self._shard(model, trained=True, cpu_offload=getattr(config, "fsdp_cpu_offload", False),
                                     reshard_layers=self._reshard_layers, layers_per_group=per_group)
            from torch.distributed.fsdp import FSDPModule

            self._fsdp_groups = [m for m in self._fsdp.modules() if isinstance(m, FSDPModule)]
            if ref_model is not None:
                self._shard(ref_model, trained=False, cpu_offload=False, reshard_layers=True,
                            layers_per_group=per_group)
        return self

    def check_sizes(self, config) -> None:
        """config's batch splits into equal shares of whole groups, minibatches and micro-batches per process (the
        CLI checks before it prepares the output folder: --overwrite-output-dir deletes)."""
        world, G = self.world_size, config.num_generations
        if (config.batch_size // G) % world:
            raise ValueError(f"batch_size: expected a multiple of {G * world} (num_generations {G} x {world} "
                             f"processes: each takes whole groups), got {config.batch_size}")
        local = config.batch_size // world
        if local % config.num_minibatches:
            raise ValueError(f"num_minibatches: expected a divisor of {local} (each of the {world} processes' "
                             f"{config.batch_size} / {world} completions), got {config.num_minibatches}")
        minibatch = local // config.num_minibatches  # one process's
        if minibatch % config.micro_batch_size:
            raise ValueError(f"micro_batch_size: expected a divisor of {minibatch} (each of the {world} processes' "
                             f"minibatch of {config.batch_size} / {world} / num_minibatches "
                             f"{config.num_minibatches}), got {config.micro_batch_size}")

    def _shard(self, model: torch.nn.Module, *, trained: bool, cpu_offload: bool, reshard_layers: bool,
               layers_per_group: int) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # pinned host memory speeds the copies to a GPU, and needs one
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if cpu_offload else OffloadPolicy()
        layers = decoder_layers(model, architecture(model))
        for start in range(0, len(layers), layers_per_group):
            group = layers[start:start + layers_per_group]  # one FSDP2 group: gathered and reduced together
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh, offload_policy=offload,
                        reshard_after_forward=reshard_layers)
        # The root group: embeddings, final norm, lm_head. A frozen copy drops them after each pass; the trained
        # model keeps them from the first micro-batch to the last backward (finish_gradients releases them).
        policy = fully_shard(_Policy(model), mesh=mesh, offload_policy=offload, reshard_after_forward=not trained)
        if trained:
            policy.set_reshard_after_backward(False, recurse=False)
        # FSDP2 picks its root at the first forward: make it the _Policy now, before a rollout runs the layers alone.
        policy(_no_pass)
        policy.reshard()
        self._wrappers[id(model)] = policy
        return policy

    # ---- the step ----
    def shard(self, indices: list[int]) -> tuple[list[int], list[int]]:
        """(keys, indices) of this rank's equal share of the step's prompts: keys are their positions in the whole
        batch (the sampling noise's key), indices their dataset rows."""
        per_rank = len(indices) // self.world_size
        keys = list(range(self.rank * per_rank, (self.rank + 1) * per_rank))
        return keys, [indices[k] for k in keys]

    def generate(self, engine, prompts, keys: list[int], **kwargs):
        """engine.generate for this rank's prompts, keyed by their positions when the engine takes keys; under
        FSDP2 with every weight gathered for the call."""
        if accepts_prompt_keys(engine):
            kwargs["prompt_keys"] = keys
        with self.full_weights():
            return engine.generate(prompts, **kwargs)

    @contextlib.contextmanager
    def full_weights(self):
        """FSDP2: all-gather every group, keep it through the block (forward hooks then do no communication, so
        the decode step can be compiled and CUDA-graphed), release it after."""
        for m in self._fsdp_groups:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for m in self._fsdp_groups:
                m.set_reshard_after_forward(self._reshard_layers and m is not self._fsdp, recurse=False)
                m.reshard()

    def forward(self, fn: Callable, model: torch.nn.Module, *args, **kwargs):
        """fn(model, *args, **kwargs), through model's DDP / FSDP2 wrapper when it has one."""
        wrapper = self._wrappers.get(id(model))
        return fn(model, *args, **kwargs) if wrapper is None else wrapper(fn, *args, **kwargs)

    def sync_gradients(self, sync: bool) -> None:
        """Whether the next forward/backward reduces its gradients (the minibatch's last micro-batch) or only
        accumulates them locally. DDP: what DDP.no_sync sets. FSDP2 reduce-scatters every backward into sharded
        gradients (the unsharded gradients of one group alive at a time) unless fsdp_sync_every_micro_batch is off:
        then the micro-batches before the last keep every group gathered and accumulate unsharded gradients."""
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = sync
        elif not self._sync_every_micro_batch:
            for m in self._fsdp_groups:
                m.set_requires_gradient_sync(sync, recurse=False)
                if m is not self._fsdp:  # the root group stays gathered until finish_gradients anyway
                    m.set_reshard_after_forward(sync and self._reshard_layers, recurse=False)
                    m.set_reshard_after_backward(sync, recurse=False)

    def finish_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """After a minibatch's last backward: release FSDP2's gathered root weights (the optimizer steps the
        shards), clip the gradients to max_norm by their global norm; returns that norm (a plain tensor)."""
        if self._fsdp is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        from torch.distributed.tensor import DTensor

        self._fsdp.reshard()
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        # the shards are disjoint: the global squared norm is the sum of the ranks' (computed here rather than by
        # clip_grad_norm_ on DTensors, which cannot reduce shards that CPU offload keeps in host memory), summed
        # with a few launches per device: four per tensor kept the GPU waiting on the host (profile, NOTES.md)
        norms = torch._foreach_norm(grads, 2.0)
        squares = sum(torch.stack([n for n in norms if n.device == device]).double().square().sum().to(self.device)
                      for device in {n.device for n in norms})
        dist.all_reduce(squares)
        norm = squares.sqrt().float()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s formula
        for device in {g.device for g in grads}:
            torch._foreach_mul_([g for g in grads if g.device == device], coef.to(device))
        return norm

    # ---- collectives on small tensors ----
    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return value
        out = value.detach().to(self.device, copy=True)
        dist.all_reduce(out)
        return out.to(value.device)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(value) / self.world_size if self.active else value

    def max(self, *values: int) -> list[int]:
        """Each value's largest over the ranks, the same on every rank: decisions that lead into collectives (saving,
        stopping) agree."""
        if not self.active:
            return list(values)
        out = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out.tolist()

    def agree(self, decide: Callable[[], bool]) -> bool:
        """decide() on every rank, True on all when it is True on any; when it raises on one rank it raises on all
        (raise_together), where one rank's error left the others waiting in this decision's collective."""
        return bool(self.max(int(self.raise_together(decide)))[0])

    def check_final_exportable(self, output_dir: str | Path, model: torch.nn.Module | None = None) -> None:
        """final_export.check_final_exportable on rank 0 (final/ is its folder, the export its work), its refusal
        raised on every rank."""
        self.raise_together(lambda: self.is_main and check_final_exportable(output_dir, model))

    def gather_rows(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's rows [n, ...] -> the whole batch's [world * n, ...] in rank order (every share equal)."""
        if not self.active:
            return value
        local = value.detach().to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(value.device)

    def gather_ragged(self, value: torch.Tensor | None) -> torch.Tensor | None:
        """A 1-D tensor of any length per rank -> their concatenation in rank order (None stays None)."""
        if not self.active or value is None:
            return value
        sizes = self.gather_rows(torch.tensor([value.numel()], device=self.device)).tolist()
        padded = torch.zeros(max(sizes), dtype=value.dtype, device=self.device)
        padded[: value.numel()] = value.detach().reshape(-1)
        parts = self.gather_rows(padded[None])
        return torch.cat([row[:n] for row, n in zip(parts, sizes)]).to(value.device)

    def gather_objects(self, value) -> list:
        """A picklable value of every rank -> their list in rank order (the same on every rank)."""
        if not self.active:
            return [value]
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def gather_on_main(self, value) -> list | None:
        """A picklable value of every rank -> their list in rank order on rank 0, None on the others (gather_objects
        where only rank 0 uses them: an evaluation's completions)."""
        if not self.active:
            return [value]
        values = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, values, dst=0)
        return values

    def own_rows(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole-batch tensor (the inverse of gather_rows)."""
        n = value.shape[0] // self.world_size
        return value[self.rank * n:(self.rank + 1) * n]

    def raise_together(self, check: Callable[[], object]):
        """Run `check` and return what it returns; if it raises on any rank, raise on every rank (the others with
        the first failing rank's message), so that no rank goes on into a collective that the failed ones will never
        join."""
        if not self.active:
            return check()
        result = failure = None
        try:
            result = check()
        except Exception as err:  # noqa: BLE001 - re-raised below, on this rank and on the others
            failure = err
        messages = self.gather_objects(None if failure is None else (type(failure), str(failure)))
        if failure is not None:
            raise raised_on_every_process(failure)
        first = next((m for m in messages if m is not None), None)
        if first is not None:
            kind, text = first
            raise raised_on_every_process(kind(f"(on process {messages.index(first)}) {text}"))
        return result

    def combine_metrics(self, metrics: dict) -> dict:
        """Rank 0's view of the step: the per-rank throughputs and error counts summed, the peak memory the
        highest, fractions averaged (every rank holds an equal share)."""
        if not self.active:
            return metrics
        names = [k for k in (*SUMMED, *MAXED, *AVERAGED) if k in metrics]
        values = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64)
        summed = self.all_reduce_sum(values).tolist()
        highest = values.to(self.device)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        for name, total, top in zip(names, summed, highest.tolist()):
            metrics[name] = top if name in MAXED else total / self.world_size if name in AVERAGED else total
        return metrics

    def on_main(self, factory: Callable, *args, **kwargs):
        """factory(*args, **kwargs) on rank 0 (metrics log, console); a do-nothing stand-in on the others."""
        return factory(*args, **kwargs) if self.is_main else _Silent()

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    @contextlib.contextmanager
    def run_directory(self, output_dir):
        """Rank 0 locks and prepares output_dir (fastgrpo.train.run_dir); the others wait until it has, and raise its
        error when it refuses the folder (another run's files or lock)."""
        with contextlib.ExitStack() as stack:
            yield _SharedRunDirectory(self.raise_together(
                lambda: stack.enter_context(RunDirectory(output_dir)) if self.is_main else None), self)

    # ---- checkpoints ----
    def save_checkpoint(self, path: Path, model: torch.nn.Module, optimizer, state: dict) -> Path:
        """checkpoint-<step>/ of this run. One process or DDP: rank 0 writes it (fastgrpo.train.checkpoint; the
        state is the same on every rank). FSDP2: every rank writes its shard of the weights and AdamW states with
        Distributed Checkpoint into <path>/shards, rank 0 the rest; the folder appears whole or not at all. optimizer:
        None where the run keeps none between checkpoints (expert iteration: a fresh one each round)."""
        path = Path(path)
        if self.active:
            state = {**state, "world_size": self.world_size}
        if self._fsdp is None:
            if self.is_main:
                save_plain_checkpoint(path, model, state)
            self.barrier()
            return path
        import torch.distributed.checkpoint as dcp

        state = {**state, "rng": state.get("rng") or rng_states(), "sharded": True}
        state.pop("optimizer", None)
        with atomic_directory(path) if self.is_main else contextlib.nullcontext() as tmp:
            where = [str(tmp)]
            dist.broadcast_object_list(where, src=0)
            dcp.save(sharded_state(model, optimizer), checkpoint_id=Path(where[0]) / SHARDS)
            if self.is_main:
                torch.save(state, tmp / STATE_FILE)
                write_run_config(tmp, state.get("config", {}))
        self.barrier()
        return path

    def restore_checkpoint(self, path: Path, state: dict, model: torch.nn.Module, optimizer) -> dict:
        """Load checkpoint `path` (its state read by read_checkpoint) into model, optimizer and the RNGs; return
        the rest of the state (step, scheduler, beta, ...). A full fine-tuning run resumes on another process count
        than the one that wrote it: FSDP2 shards load into any number of processes (one: whole), whole weights into
        this run's shards."""
        check_same_checkpoint(self, path)
        saved_world = state.pop("world_size", 1)
        sharded = state.pop("sharded", False)
        if saved_world != self.world_size and self.is_main:
            logger.warning("resume: %s was written by %d process(es), this run has %d", path.name, saved_world,
                           self.world_size)
        if sharded:
            load_sharded_state(Path(path) / SHARDS, model, optimizer)
            set_rng_states(state.pop("rng"))
            return state
        if self._fsdp is not None:
            return self._restore_whole_into_shards(state, model, optimizer)
        state = restore_checkpoint(state, model)
        if optimizer is not None:
            optimizer.load_state_dict(state.pop("optimizer"))
        return state

    @staticmethod
    def _restore_whole_into_shards(state: dict, model: torch.nn.Module, optimizer) -> dict:
        """A checkpoint of whole weights (one process's) into this FSDP2 run: each process takes its shards of the
        trainable parameters and of the optimizer's states (keyed by parameter position there, by name here)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        state = dict(state)
        saved, names = state.pop("trainable"), [n for n, p in model.named_parameters() if p.requires_grad]
        if sorted(saved) != sorted(names):
            differ = sorted(set(saved).symmetric_difference(names))
            raise ValueError(f"checkpoint: its trainable parameters and the model's differ ({differ[:3]}); was it "
                             "built the same way?")
        options = StateDictOptions(full_state_dict=True, strict=False)  # strict: tied weights are saved once
        if optimizer is None:
            set_model_state_dict(model, saved, options=options)
        else:
            by_position = state.pop("optimizer")
            by_name = {"state": {names[i]: value for i, value in by_position["state"].items()},
                       "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                        for group in by_position["param_groups"]]}
            set_state_dict(model, optimizer, model_state_dict=saved, optim_state_dict=by_name, options=options)
        set_rng_states(state.pop("rng"))
        return state

    def export(self, export: Callable, model: torch.nn.Module, tokenizer, path: Path,
               run_config: dict | None = None, step: int | None = None) -> Path:
        """export(model, tokenizer, path, run_config=, step=) on rank 0; under FSDP2 the full weights are gathered
        first (every rank takes part) and the model is saved from them, with the run's config and the step's record
        beside (export_model)."""
        if self._fsdp is None:
            if self.is_main:
                export(model, tokenizer, path, run_config=run_config, step=step)
            self.barrier()
            return Path(path)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        for name in _repeated_parameters(model):  # tied embeddings: saved once, as save_pretrained saves a model's own
            full.pop(name, None)  # rank 0 alone holds the full state
        if self.is_main:
            with atomic_directory(path) as tmp:
                model.save_pretrained(tmp, state_dict=full)
                finish_export(tmp, tokenizer, run_config, step)
        self.barrier()
        return Path(path)


def _repeated_parameters(model: torch.nn.Module) -> list[str]:
    """The names under which a parameter seen earlier is registered again (a tied lm_head): get_model_state_dict
    copies each name's tensor apart, and save_pretrained, given them, saved the head beside the embedding (a
    vocab x hidden copy more in final/ than a single process's export or `fastgrpo export` of the checkpoint)."""
    seen, repeated = set(), []
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            repeated.append(name)
        seen.add(id(parameter))
    return repeated


class _SharedRunDirectory:
    """The run directory of every rank: rank 0's RunDirectory (None on the others), prepared by rank 0."""

    def __init__(self, run_dir: RunDirectory | None, group: Distributed):
        self.run_dir, self.group = run_dir, group

    def prepare(self, **kwargs) -> None:
        self.group.raise_together(lambda: self.run_dir and self.run_dir.prepare(**kwargs))
